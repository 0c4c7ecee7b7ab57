"""What every Gated DeltaNet family's registry entry (qwen3_next, qwen3_5, qwen3_5_moe) says alike: its shapes
(dtlaunch/models/qwen3_next/shapes.py), its tensor-parallel plan (tp_plan.py: the linear blocks split by key
heads), context parallel as Ulysses only (no ring attention), and its closed-form activation terms (activations.py:
the Gated DeltaNet and the gated full-attention blocks, with the dense or MoE FFN)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import dtlaunch.models.qwen3_next.shapes as shapes
from dtlaunch.models.qwen3_next.check import cp_divides_key_heads


def hybrid_spec(base: Any, builder: str, *, split_projections: bool, **fields: Any) -> Any:
    """`base` (a dense_spec or moe_spec) as a hybrid family built by `builder` ("module:function");
    `split_projections`: Qwen3.5's in_proj_qkv / z / b / a instead of Qwen3-Next's fused in_proj_qkvz / ba."""
    linears = functools.partial(shapes.block_linears, split=split_projections)
    return dataclasses.replace(
        base,
        builder=builder,
        tp_plan="dtlaunch.models.qwen3_next.tp_plan",
        param_count=shapes.param_count,
        block_params=shapes.block_params,
        block_norm_params=shapes.block_norm_params,
        flops_per_token=shapes.flops_per_token,
        matmul_params=shapes.matmul_params,
        tp_divisors=shapes.tp_divisors,
        block_linears=linears,
        activations="dtlaunch.models.qwen3_next.activations",
        ring_attention=False,
        # Context parallel as Ulysses only (the linear blocks need the whole sequence in order: check.py).
        ulysses_blocks=True,
        ulysses_degree_ok=cp_divides_key_heads,
        check_layout="dtlaunch.models.qwen3_next.check:check_layout",
        **fields,
    )
