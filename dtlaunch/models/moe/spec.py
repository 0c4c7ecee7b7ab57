"""The MoE decoder's registry entry, parametrised per family (qwen3_moe, mixtral, glm4_moe, moe)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import dtlaunch.models.moe.flops as flops
import dtlaunch.models.moe.shapes as shapes
from dtlaunch.models.moe.config import MoeModelConfig, routed_experts
from dtlaunch.models.registry import ModelSpec


def moe_spec(
    arch: str, description: str, hf: Optional[Any], hf_names: str, hf_architectures: tuple[str, ...], **fixed: Any
) -> ModelSpec:
    return ModelSpec(
        arch=arch,
        description=description,
        builder="dtlaunch.models.moe.model:build_model",
        tp_plan="dtlaunch.models.moe.tp_plan",
        pipeline_split="dtlaunch.models.dense.model:split_stage",
        hf_architectures=hf_architectures,
        hf=hf,
        hf_names=hf_names,
        param_count=shapes.param_count,
        block_params=shapes.block_params,
        block_norm_params=shapes.block_norm_params,
        embedding_params=shapes.embedding_params,
        head_params=shapes.head_params,
        flops_per_token=flops.flops_per_token,
        matmul_params=flops.matmul_params,
        tp_divisors=shapes.tp_divisors,
        block_linears=functools.partial(shapes.block_linears, hf=bool(hf_names)),
        activations="dtlaunch.models.moe.activations",
        check="dtlaunch.models.moe.check:check",
        fixed=dict(fixed),
        config=MoeModelConfig,
        routed_experts=routed_experts,
    )
