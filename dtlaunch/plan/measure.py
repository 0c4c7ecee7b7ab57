"""Single-process measured peak for calibrating the planner (imports torch; tests and bench only).

Rank 0 of an N-rank world, emulated in this process on REAL CPU tensors with the runtime's own build
and step code (dtlaunch.plan.trace with fake=False): collectives move no data but allocate what a real
rank allocates, so the tracked peak is that of rank 0 of a real N-rank run (checked against real gloo
runs: equal to 0.01 %). Pipeline layouts need real peers and are measured by real runs only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.layout import Layout

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def measure_peak(cfg: JobConfig, world: int, steps: int = 3) -> int:
    """Peak tracked bytes on rank 0 of `cfg`'s layout over a world of `world` ranks."""
    from dtlaunch.plan.trace import trace_peak

    return int(trace_peak(cfg, Layout.resolve(cfg.strategy, world), steps=steps, fake=False)["peak_bytes"])
