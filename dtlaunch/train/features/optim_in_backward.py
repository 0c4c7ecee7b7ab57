"""The optimizer step inside backward (`optim.in_backward=true`): each trained parameter is updated as
soon as its gradient is complete, and the gradient is freed at once, so the step never holds the
model's gradients together (only the parameter, or FSDP2 unit, being reduced).

A post-accumulate-grad hook per parameter calls its model part's optimizer's ordinary `step()`: at that
moment this parameter is the only one with a gradient (the earlier ones were freed by their hooks, the
later ones do not exist yet), so the optimizer updates it alone, with the same per-parameter arithmetic
as a step after backward, and keeps its usual state dict (checkpoints and resume are unchanged). Under
FSDP2 the hook runs on the sharded parameter after its reduce-scatter (torch's fully_shard calls it).

The gradient norm (reported, not clipped: validate refuses training.grad_clip > 0) is summed from each
gradient's local squares as it passes, then all-reduced over the shard group once per step. A
non-finite gradient is applied like any other (there is no later step to skip); the loop still counts
the step as bad from its loss and norm.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist


class InBackward:
    def __init__(self, model_parts: list, optimizers: list, group: Optional[Any] = None) -> None:
        self.group = group
        self.sq: Optional[torch.Tensor] = None
        self.handles = []
        for part, opt in zip(model_parts, optimizers, strict=True):
            for p in part.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._step, opt)))

    def _step(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
        grad = p.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        sq = torch.linalg.vector_norm(local, 2, dtype=torch.float32).square()
        self.sq = sq if self.sq is None else self.sq + sq
        opt.step()
        p.grad = None

    def grad_norm(self, device: torch.device) -> torch.Tensor:
        """The step's global gradient norm (fp32, equal on every rank); resets the sum."""
        sq = self.sq if self.sq is not None else torch.zeros((), device=device)
        self.sq = None
        if self.group is not None:
            dist.all_reduce(sq, group=self.group)
        return sq.sqrt()
