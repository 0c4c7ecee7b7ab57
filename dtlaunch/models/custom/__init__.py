"""`model._target_=pkg.module.build`: your own nn.Module, trained with DDP / FSDP2 / AC / compile.

The entry has no tensor-parallel plan and no pipeline split (validate refuses tp > 1 and pp > 1) and
no closed-form memory model: the planner traces one step of the real runtime instead. Sizes are
counted on the meta device, so this path imports torch (and your module).
"""

from __future__ import annotations

from dtlaunch.models.registry import traced_spec

SPEC = traced_spec(
    "custom",
    "a user module named by model._target_",
    "dtlaunch.models.custom.build:build_model",
    check="dtlaunch.models.custom.check:check",
)
