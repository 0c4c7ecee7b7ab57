"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norm, free head_dim) with routed experts."""

from dtlaunch.models.moe.hf import MoEHF
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(
    moe_spec(
        "qwen3_moe",
        "Qwen3-MoE decoder (top-k softmax router, no shared experts)",
        MoEHF("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, sliding=True, expert_dim_key="moe_intermediate_size"),
        "dtlaunch.models.qwen3_moe.names",
        ("Qwen3MoeForCausalLM",),
        qkv_bias=False,
        qk_norm=True,
        **{"moe.num_shared_experts": 0, "moe.score_func": "softmax"},
    )
)
