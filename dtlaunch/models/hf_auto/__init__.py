"""`model.arch=hf_auto model.init_from=hf:DIR`: any causal LM transformers can build, for the
architectures the registry has no native entry for (Phi-3, Gemma 2, GPT-NeoX, ...).

transformers' own AutoModelForCausalLM is wrapped to follow the runtime's protocol (its decoder layers
become the `layers` the runtime wraps with FSDP2, activation checkpointing and compile). No closed-form
memory model: the planner traces one step. Tensor parallel and pipeline splitting are not supported
on this path (validate asks for strategy.tp=1 and strategy.pp=1). Needs `pip install dtlaunch[hf]`.
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.registry import ModelSpec, register


def _count(m: Any) -> int:
    from dtlaunch.models.hf_auto.build import build_model

    return sum(p.numel() for p in build_model(m, device="meta").parameters())


SPEC = register(
    ModelSpec(
        arch="hf_auto",
        description="transformers' AutoModelForCausalLM for architectures without a native entry",
        builder="dtlaunch.models.hf_auto.build:build_model",
        tp_plan="",
        pipeline_split="",
        hf_architectures=(),
        hf=None,
        hf_names="",
        param_count=_count,
        block_params=lambda m: 0,
        block_norm_params=lambda m: 0,
        embedding_params=lambda m: 0,
        head_params=lambda m: 0,
        flops_per_token=lambda m, seq: 6.0 * _count(m),
        matmul_params=_count,
        tp_divisors=lambda m: [],
        activations=None,
    )
)
