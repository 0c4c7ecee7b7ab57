"""Qwen3 dense: per-head q/k RMSNorm, head_dim independent of dim / n_heads."""

from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "qwen3",
        "Qwen3 dense decoder (q/k norm, free head_dim)",
        DenseHF("Qwen3ForCausalLM", "qwen3", qk_norm=True, sliding=True, extra_config=(("attention_bias", False),)),
        ("Qwen3ForCausalLM",),
        qkv_bias=False,
        qk_norm=True,
    )
)
