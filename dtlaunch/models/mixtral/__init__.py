"""Mixtral 8x7B / 8x22B: Mistral's attention with 8 routed experts, top-2, renormalised weights."""

from dtlaunch.models.moe.hf import MoEHF
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(
    moe_spec(
        "mixtral",
        "Mixtral decoder (top-2 of 8 softmax router, optional sliding window)",
        MoEHF("MixtralForCausalLM", "mixtral", sliding=True, uniform_window=True, experts_key="num_local_experts"),
        "dtlaunch.models.mixtral.names",
        ("MixtralForCausalLM",),
        qkv_bias=False,
        qk_norm=False,
        **{
            "moe.num_shared_experts": 0,
            "moe.score_func": "softmax",
            "moe.norm_topk": True,
            "moe.expert_dim": None,
            "moe.sparse_step": 1,
            "moe.dense_layers": [],
        },
    )
)
