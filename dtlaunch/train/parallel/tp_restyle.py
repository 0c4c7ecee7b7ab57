"""Swapping the torch styles of a tensor-parallel plan for a module's own kind of linear (float8's,
LoRA's): one walk shared by dtlaunch.train.parallel.float8 and .lora_tp."""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


def restyle(
    plan: dict[str, ParallelStyle], module: nn.Module, swap: Callable[[nn.Module, str, ParallelStyle], ParallelStyle]
) -> dict[str, ParallelStyle]:
    """`plan` (names relative to `module`) with each style replaced by `swap(target module, name, style)`;
    names this module does not own (a pipeline stage's deleted parts) are left for parallelize_module."""
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        try:
            target = module.get_submodule(name)
        except AttributeError:
            out[name] = style
            continue
        out[name] = swap(target, name, style)
    return out
