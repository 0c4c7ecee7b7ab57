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
