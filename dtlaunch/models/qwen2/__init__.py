"""Qwen2 / Qwen2.5: the dense decoder with q/k/v biases (tied embeddings on the small sizes)."""

from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "qwen2",
        "Qwen2 / Qwen2.5 decoder (q/k/v bias)",
        DenseHF("Qwen2ForCausalLM", "qwen2", qkv_bias=True, sliding=True),
        ("Qwen2ForCausalLM",),
        qkv_bias=True,
        qk_norm=False,
    )
)
