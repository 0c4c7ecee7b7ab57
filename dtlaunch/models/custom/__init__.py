"""`model._target_=pkg.module.build`: your own nn.Module, trained with DDP / FSDP2 / AC / compile.

The entry has no tensor-parallel plan and no pipeline split (validate refuses tp > 1 and pp > 1) and
no closed-form memory model: the planner traces one step of the real runtime instead. Sizes are
counted on the meta device, so this path imports torch (and your module).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.registry import ModelSpec


def _count(m: Any) -> int:
    from dtlaunch.models.custom.build import build_model

    return sum(p.numel() for p in build_model(m, device="meta").parameters())


def _flops(m: Any, seq_len: int) -> float:
    return 6.0 * _count(m)  # weights only: the module's attention cost is not known in closed form


SPEC = ModelSpec(
    arch="custom",
    description="a user module named by model._target_",
    builder="dtlaunch.models.custom.build:build_model",
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
    flops_per_token=_flops,
    matmul_params=_count,
    tp_divisors=lambda m: [],
    activations=None,
)
