"""The training loop's side of mixture-of-experts balancing (dtlaunch/models/moe/balance.py).

After every step: the auxiliary-loss-free bias update (one all-reduce of the token counts over the
data-parallel ranks, on the device, no host sync) and this rank's router statistics as a device tensor,
which the loop hands to its once-per-window sync (dtlaunch.train.step_sync) with the losses; the
counters are then zeroed. Nothing here runs for dense models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from dtlaunch.models.moe import balance
from dtlaunch.models.moe.shapes import sparse_layers
from dtlaunch.models.registry import routed_experts

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


class RouterTracker:
    def __init__(
        self, cfg: JobConfig, parts: list[nn.Module], dp_group: Any, tp: int, aux_grad_scale: float, pipeline: bool
    ) -> None:
        m = cfg.model
        self.n_layers, self.num_experts = int(m.n_layers), int(m.moe.num_experts)
        self.sparse = sparse_layers(m)
        self.rate = float(m.moe.bias_update_rate)
        self.group, self.tp = dp_group, int(tp)
        balance.set_aux_grad_scale(parts, aux_grad_scale)
        if pipeline:
            for part in parts:
                _forget_first_forward(part)

    @classmethod
    def maybe(
        cls,
        cfg: JobConfig,
        parts: list[nn.Module],
        dp_group: Any,
        tp: int,
        aux_grad_scale: float,
        pipeline: bool = False,
    ) -> Optional[Any]:
        """A tracker when the model has MoE layers, else None."""
        if routed_experts(cfg.model) == 0:
            return None
        if not any(balance.moe_layers(p) for p in parts):
            return None
        return cls(cfg, parts, dp_group, tp, aux_grad_scale, pipeline)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def after_step(self, parts: list[nn.Module]) -> Optional[torch.Tensor]:
        for part in parts:
            balance.update_expert_bias(part, self._reduce, self.rate)
        stats = balance.step_stats(parts, self.n_layers, self.num_experts)
        balance.reset(parts)
        return stats

    def summarize(self, values: list[float]) -> dict[str, Any]:
        return balance.summarize(values, self.sparse, self.num_experts, self.tp)


def _forget_first_forward(part: nn.Module) -> None:
    """A pipeline stage's first forward is torch's shape / metadata inference (the first micro-batch on
    the first stage, empty tensors on the others), run with grad on recent torch: what it routed is no
    training step's, so the counters it touched are zeroed once it returns."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        balance.reset([module])
        handle.remove()

    handle = part.register_forward_hook(hook)
