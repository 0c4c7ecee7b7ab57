"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): the MoE decoder whose blocks mix tokens with Gated
DeltaNet linear attention (three in four by default) or gated full attention (an output gate from q_proj,
(1 + gain) q/k norms, partial RoPE), with routed experts plus one shared expert behind a sigmoid gate.
The planner counts its activations in closed form (activations.py)."""

from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.qwen3_next.config import Qwen3NextModelConfig
from dtlaunch.models.qwen3_next.hf import Qwen3NextHF
from dtlaunch.models.qwen3_next.spec import hybrid_spec
from dtlaunch.models.registry import register

SPEC = register(
    hybrid_spec(
        moe_spec(
            "qwen3_next",
            "Qwen3-Next decoder (Gated DeltaNet and gated full attention, top-k softmax router, gated shared expert)",
            Qwen3NextHF("Qwen3NextForCausalLM", "qwen3_next", qk_norm=True),
            "dtlaunch.models.qwen3_next.names",
            ("Qwen3NextForCausalLM",),
            qkv_bias=False,
            qk_norm=True,
            norm_offset=1.0,
            attention_output_gate=True,
            shared_expert_gate=True,
            **{"moe.score_func": "softmax"},
        ),
        "dtlaunch.models.qwen3_next.model:build_model",
        split_projections=False,
        config=Qwen3NextModelConfig,
        check="dtlaunch.models.qwen3_next.check:check",
    )
)
