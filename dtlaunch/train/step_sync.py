"""What the ranks agree on after their steps, in one collective per logging window, read one window later.

After each step every rank must learn the data-parallel mean loss (for the metrics), whether the update
was applied (bad-step accounting) and whether any rank was asked to stop (preemption). These travel in
a single SUM all-reduce per logging window (`training.log_every` steps), issued without waiting at the
window's last step and read when the next window ends (or when the run stops). Neither the host nor
the device waits in between: on a GPU the copy to host memory is queued behind the collective and is
long finished when it is read, so kernel queueing never stalls; on CPU/gloo the collective runs in
gloo's worker thread while the next steps compute.

The trade-off: metrics lines, the bad-step check and a preemption stop lag by one window (one step at
the default log_every=1). Every rank reads the same window at the same step, so they still all stop
after the same step.

Fast steps widen the window (training.sync_interval_s): a collective costs a fixed ~0.7 ms on CPU/gloo
whatever it carries, 4 % of a tiny model's step. Global rank 0 proposes the next window length (whole
multiples of log_every, enough steps to span the interval at its measured step time) inside the
collective itself, so every rank adopts the same length at the same step without another message.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class StepOutcome:
    """One step as every rank sees it once its window is read."""

    step: int
    loss: float  # data-parallel mean
    grad_norm: float
    applied: bool
    host: dict[str, Any] = field(default_factory=dict)  # values the loop measured on the host (lr, time)
    stats: Optional[list[float]] = None  # the step's extra vector (router statistics), summed over ranks
    ranks: Optional[list[float]] = None  # a window's last step: the per-rank payload (observe.stragglers)


@dataclass
class _Window:
    steps: list[int]
    host: list[dict[str, Any]]
    reduced: torch.Tensor  # [loss per step..., asked, signal number, next window], summed over ranks
    local: torch.Tensor  # [grad norm per step..., applied per step...] (equal on every rank already)
    stats_len: int = 0  # per step, at the end of `reduced` (after the flags)
    ranks_len: int = 0  # the per-rank payload, at the very end of `reduced`
    work: Any = None  # the all-reduce in flight (gloo: waited for when read)
    ready: Any = None  # CUDA event after the copies to the host


class WindowSync:
    """`push(step, ...)` after every step; returns the outcomes of the window that became readable."""

    MAX_WINDOWS = 100  # a window spans at most this many log_every periods

    def __init__(
        self, device: torch.device, log_every: int, total_steps: int, interval_s: float = 0.0, pace: Any = None
    ) -> None:
        self.device = device
        self.pace = pace  # dtlaunch.train.observe.stragglers.RankPace: one slot per rank in each window
        self.log_every = max(1, int(log_every))
        self.total_steps = int(total_steps)
        self.interval_s = float(interval_s)
        self.window = self.log_every  # steps per window: the same on every rank (see `_read`)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.proposer = not dist.is_initialized() or dist.get_rank() == 0
        self._t_sent = time.perf_counter()
        self.signum = 0  # the stop signal every rank agreed on (0: none yet)
        self._losses: list[Any] = []  # floats on the host (CPU), device scalars on a GPU
        self._norms: list[Any] = []
        self._applied: list[Any] = []
        self._steps: list[int] = []
        self._host: list[dict[str, Any]] = []
        self._stats: list[Any] = []
        self._in_flight: Optional[_Window] = None

    def push(
        self,
        step: int,
        local_loss: torch.Tensor,
        grad_norm: Any,
        applied: Any,
        signal_requested: int,
        stats: Optional[torch.Tensor] = None,
        **host: Any,
    ) -> list[StepOutcome]:
        """Record this step; at a window's end send it and return the previous window's outcomes.
        `stats`: a device vector of the same length every step and rank, summed over ranks with the loss."""
        self._steps.append(int(step))
        self._host.append(host)
        if self.device.type != "cuda":
            # Host memory: the values are read now (free: there is no kernel queue to wait for), so the
            # window becomes one small tensor instead of a dozen tiny tensor ops per step.
            self._losses.append(float(local_loss))
            self._norms.append(float(grad_norm))
            self._applied.append(bool(applied))
            if stats is not None:
                self._stats.append(stats.detach().float().reshape(-1).tolist())
        else:
            self._losses.append(local_loss.detach().float().reshape(()))
            self._norms.append(torch.as_tensor(grad_norm, dtype=torch.float32, device=self.device).reshape(()))
            self._applied.append(applied)
            if stats is not None:
                self._stats.append(stats.detach().float().reshape(-1))
        if len(self._steps) < self.window and step < self.total_steps:
            return []
        previous = self._in_flight
        self._in_flight = self._send(signal_requested)
        return self._read(previous) if previous is not None else []

    def drain(self, signal_requested: int = 0) -> list[StepOutcome]:
        """Everything not read yet (the run ends or stops): send the open window, read both."""
        out = self._read(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        if self._steps:
            out += self._read(self._send(signal_requested))
        return out

    def _proposal(self) -> float:
        """Rank 0's next window length (0 from the others, so the sum is rank 0's): enough log_every
        periods to span interval_s at the step time measured over the window being sent."""
        now, n = time.perf_counter(), len(self._steps)
        step_s, self._t_sent = (now - self._t_sent) / max(1, n), now
        if not self.proposer:
            return 0.0
        if self.interval_s <= 0 or step_s <= 0:
            return float(self.log_every)
        periods = math.ceil(self.interval_s / (step_s * self.log_every))
        return float(self.log_every * min(self.MAX_WINDOWS, max(1, periods)))

    def _send(self, signal_requested: int) -> _Window:
        if self.device.type != "cuda":
            return self._send_host(signal_requested)
        flags = torch.tensor([float(signal_requested > 0), float(signal_requested), self._proposal()])
        # Pinned: a blocking copy from pageable memory would synchronise the stream.
        flags = flags.pin_memory().to(self.device, non_blocking=True)
        stats_len = self._stats[0].numel() if self._stats else 0
        ranks = self.pace.payload() if self.pace is not None else []
        extra = [torch.tensor(ranks).pin_memory().to(self.device, non_blocking=True)] if ranks else []
        reduced = torch.cat([torch.stack(self._losses), flags, *self._stats, *extra])
        if all(isinstance(a, torch.Tensor) for a in self._applied):  # decided on the device
            applied = torch.stack([a.float() for a in self._applied])
        else:  # decided on the host (CPU, GradScaler): the flags are plain booleans
            applied = torch.tensor([float(bool(a)) for a in self._applied]).pin_memory()
            applied = applied.to(self.device, non_blocking=True)
        local = torch.cat([torch.stack(self._norms), applied.to(self.device)])
        win = _Window(self._steps, self._host, reduced, local, stats_len, len(ranks))
        self._steps, self._host, self._losses, self._norms, self._applied = [], [], [], [], []
        self._stats = []
        if self.world > 1:
            win.work = dist.all_reduce(win.reduced, async_op=True)
        # NCCL: wait() only orders the current stream after the collective; the copies follow it on the
        # stream and the event says when they are done, so reading later never drains the queue.
        if win.work is not None:
            win.work.wait()
            win.work = None
        win.reduced = win.reduced.to("cpu", non_blocking=True)
        win.local = win.local.to("cpu", non_blocking=True)
        win.ready = torch.cuda.Event()
        win.ready.record()
        return win

    def _send_host(self, signal_requested: int) -> _Window:
        """The CPU path of `_send`: the same window, built from host numbers."""
        flags = [float(signal_requested > 0), float(signal_requested), self._proposal()]
        stats_len = len(self._stats[0]) if self._stats else 0
        ranks = self.pace.payload() if self.pace is not None else []
        reduced = torch.tensor([*self._losses, *flags, *(v for row in self._stats for v in row), *ranks])
        local = torch.tensor([*self._norms, *(float(a) for a in self._applied)])
        win = _Window(self._steps, self._host, reduced, local, stats_len, len(ranks))
        self._steps, self._host, self._losses, self._norms, self._applied = [], [], [], [], []
        self._stats = []
        if self.world > 1:
            win.work = dist.all_reduce(win.reduced, async_op=True)
        return win

    def _read(self, win: _Window) -> list[StepOutcome]:
        if win.work is not None:
            win.work.wait()
        if win.ready is not None:
            win.ready.synchronize()
        values = win.reduced.tolist()
        local = win.local.tolist()
        n = len(win.steps)
        asked, total, window = values[n], values[n + 1], round(values[n + 2])
        if asked and not self.signum:
            self.signum = round(total / asked)  # the mean signal number over the ranks that got one
        self.window = max(self.log_every, window)
        k = win.stats_len
        out = [
            StepOutcome(
                step,
                values[i] / self.world,
                local[i],
                bool(local[n + i]),
                win.host[i],
                values[n + 3 + i * k : n + 3 + (i + 1) * k] if k else None,
            )
            for i, step in enumerate(win.steps)
        ]
        if win.ranks_len and out:
            out[-1].ranks = values[len(values) - win.ranks_len :]
        return out
