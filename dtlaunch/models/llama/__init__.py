"""Llama 2 / 3 / 3.1 / 3.2 (tied embeddings on 3.2 1B/3B): the dense decoder without extras."""

from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "llama",
        "Llama 2 / 3.x decoder (GQA, SwiGLU, RoPE with Llama-3.1 scaling)",
        DenseHF("LlamaForCausalLM", "llama", extra_config=(("attention_bias", False), ("mlp_bias", False))),
        ("LlamaForCausalLM",),
        qkv_bias=False,
        qk_norm=False,
        sliding_window=None,
    )
)


def __getattr__(name: str) -> object:
    """The decoder's modules by their old address (`from dtlaunch.models.llama import build_model`),
    imported on first use so that importing this entry stays torch-free."""
    from dtlaunch.models.dense import model

    if hasattr(model, name):
        return getattr(model, name)
    raise AttributeError(f"module 'dtlaunch.models.llama' has no attribute '{name}'")
