"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): the MoE decoder whose blocks mix tokens with Gated
DeltaNet linear attention (three in four by default) or gated full attention (an output gate from q_proj,
(1 + gain) q/k norms, partial RoPE), with routed experts plus one shared expert behind a sigmoid gate.
The planner traces its step (no closed-form activation terms for the linear blocks yet)."""

import dataclasses

import dtlaunch.models.qwen3_next.shapes as shapes
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.qwen3_next.config import Qwen3NextModelConfig
from dtlaunch.models.qwen3_next.hf import Qwen3NextHF
from dtlaunch.models.registry import register

SPEC = register(
    dataclasses.replace(
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
        builder="dtlaunch.models.qwen3_next.model:build_model",
        tp_plan="",
        param_count=shapes.param_count,
        block_params=shapes.block_params,
        block_norm_params=shapes.block_norm_params,
        flops_per_token=shapes.flops_per_token,
        matmul_params=shapes.matmul_params,
        tp_divisors=shapes.tp_divisors,
        block_linears=shapes.block_linears,
        activations=None,
        ring_attention=False,
        config=Qwen3NextModelConfig,
        check="dtlaunch.models.qwen3_next.check:check",
    )
)
