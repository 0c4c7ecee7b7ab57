"""The dense decoder's registry entry, parametrised per family (llama, qwen2, qwen3, mistral, smollm3, olmo3, gemma3)."""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import flops, shapes
from dtlaunch.models.dense.config import DenseModelConfig
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.registry import ModelSpec


def dense_spec(
    arch: str,
    description: str,
    hf: DenseHF,
    hf_architectures: tuple[str, ...],
    config: type = DenseModelConfig,
    check: str = "dtlaunch.models.dense.check:check",
    hf_names: str = "dtlaunch.models.dense.hf",
    **fixed: Any,
) -> ModelSpec:
    """`config`: the model section's schema (a subclass of DenseModelConfig for a family's own fields);
    `check`: its rules; `hf_names`: its tensor names module; `fixed`: the decoder flags the family fixes."""
    return ModelSpec(
        arch=arch,
        description=description,
        builder="dtlaunch.models.dense.model:build_model",
        tp_plan="dtlaunch.models.dense.tp_plan",
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
        activations="dtlaunch.models.dense.activations",
        fixed=dict(fixed),
        block_linears=shapes.block_linears,
        check=check,
        config=config,
    )
