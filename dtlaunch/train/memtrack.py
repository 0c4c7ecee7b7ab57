"""Measured peak memory per rank: what the planner's prediction is checked against.

CUDA: the caching allocator's `max_memory_allocated` (tensor bytes, like the plan's main figure).
CPU: there is no allocator statistic, so tensor storages are accounted with torch's MemTracker
(a dispatch mode that sees every allocation) over the first `track_steps` steps; after those the
mode is left, so the rest of the run pays nothing. The peak of a step appears from step 2 on
(Adam state is created by the first optimizer step), hence the default of 3 tracked steps.

Usage from the training loop:
    tracker = PeakTracker(model_parts, optimizers, enabled=True)
    with tracker.step(step):
        ...one whole optimizer step (forward, backward, optimizer.step, zero_grad)...
    tracker.peak_bytes()
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


class PeakTracker:
    def __init__(
        self,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[Any],
        enabled: bool = True,
        track_steps: int = 3,
        device: torch.device | str | None = None,
    ) -> None:
        self.enabled = enabled
        self.track_steps = track_steps
        self.model_parts = list(model_parts)
        self.optimizers = [getattr(o, "optimizer", o) for o in optimizers]
        self.device = torch.device(device) if device is not None else _device_of(self.model_parts)
        self._steps_seen = 0
        self._peak = 0
        self._tracker: Any = None
        if enabled and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap one whole train step; tracks (on CPU) while fewer than `track_steps` were seen."""
        if not self.enabled or self.device.type == "cuda" or self._steps_seen >= self.track_steps:
            self._steps_seen += 1
            yield
            return
        if self._tracker is None:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._tracker = MemTracker()
            # Parameters, buffers and optimizer state exist before the mode is entered.
            self._tracker.track_external(*self.model_parts, *self.optimizers)
        with self._tracker:
            yield
        self._steps_seen += 1
        self._peak = max(self._peak, _total(self._tracker.get_tracker_snapshot("peak")))
        # Per-module statistics grow with every step; only the peak is wanted.
        self._tracker.reset_mod_stats()
        if self._steps_seen >= self.track_steps:
            self._tracker = None

    def micro_step(self) -> None:
        """Between gradient-accumulation micro-steps: MemTracker refuses a second forward of the root
        module unless its per-module statistics are reset (the global peak is kept)."""
        if self._tracker is not None:
            self._peak = max(self._peak, _total(self._tracker.get_tracker_snapshot("peak")))
            self._tracker.reset_mod_stats()

    def peak_bytes(self) -> int:
        """Peak allocated tensor bytes on this rank so far (0 when disabled)."""
        if not self.enabled:
            return 0
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self._peak)


def _total(snapshot: dict) -> int:
    return int(sum(dev_snap.get("Total", 0) for dev_snap in snapshot.values()))


def _device_of(parts: Sequence[torch.nn.Module]) -> torch.device:
    for part in parts:
        for p in part.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.device.type != "meta":
                return local.device
    return torch.device("cpu")
