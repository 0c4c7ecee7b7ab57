"""Slow ranks: each rank's own time per step, and the rank that is persistently slower than the others.

In synchronous training every rank's wall time per step is the same: the ranks leave each step together,
released by its gradient collectives, and a slow rank's delay shows up as the others' wait. What differs
is when each rank *starts* the step's work: a rank that spends longer between steps (loading data, a host
stall, heavier logging, a slow tail of the previous step) arrives late at the step's first collective,
and every other rank waits that long. So each rank measures, on its own clock (no clock agreement across
hosts is needed), the gap from the end of its previous step's work to the start of this one's, and its
period (start to start). Its own time per step is its period less the time it waited for the latest
rank: period - (largest gap - its gap).

Each rank's window means travel in the collective the loop already does once per logging window
(dtlaunch.train.step_sync), one slot per rank in a SUM all-reduce, so this costs no extra collective.

Limit: a rank slow *inside* the step's compute (a throttled device) makes the others wait inside the
step's collectives, which this does not see; per-collective timing would (NCCL's completion hooks; gloo
records only issue times, in a flight record too slow to read every window).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional


class RankPace:
    """Every rank: the gaps and periods of the steps since the last window, as the window's payload."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self._start: Optional[float] = None
        self._end: Optional[float] = None
        self._gap = self._period = 0.0
        self._n = 0

    def started(self) -> None:
        """Right before the step's work (its first collective)."""
        now = time.perf_counter()
        if self._start is not None and self._end is not None:
            self._gap += now - self._end
            self._period += now - self._start
            self._n += 1
        self._start = now

    def ended(self) -> None:
        """Right after the step's work: every rank leaves it together (its collectives released them)."""
        self._end = time.perf_counter()

    def payload(self) -> list[float]:
        """[mean gap of each rank (ms)..., mean period of each rank (ms)...], this rank's slots filled."""
        out = [0.0] * (2 * self.world)
        if self._n:
            out[self.rank] = 1e3 * self._gap / self._n
            out[self.world + self.rank] = 1e3 * self._period / self._n
        self._gap = self._period = 0.0
        self._n = 0
        return out


def own_ms(summed: list[float], world: int) -> Optional[list[float]]:
    """Each rank's own time per step (ms) from a window's summed payload; None if a rank measured nothing."""
    gaps, periods = summed[:world], summed[world : 2 * world]
    if not all(p > 0 for p in periods):
        return None
    latest = max(gaps)
    return [p - (latest - g) for g, p in zip(gaps, periods, strict=True)]


class StragglerWatch:
    """Global rank 0: the windows' per-rank times; names a rank slower than the others by > threshold."""

    RECENT = 20  # windows the live line judges by

    def __init__(self, world: int, threshold: float) -> None:
        self.world = world
        self.threshold = threshold
        self.windows: list[list[float]] = []

    def add(self, per_rank_ms: list[float]) -> None:
        self.windows.append(per_rank_ms)

    def medians(self, last: int = 0) -> list[float]:
        rows = self.windows[-last:] if last else self.windows
        return [statistics.median(row[r] for row in rows) for r in range(self.world)]

    def slowest(self, last: int = 0, min_windows: int = 3) -> Optional[dict]:
        """{rank, median_ms, others_median_ms, slower_by} for a persistently slow rank, else None."""
        if self.world < 2 or self.threshold <= 0 or len(self.windows) < min_windows:
            return None
        med = self.medians(last)
        rank = max(range(self.world), key=lambda r: med[r])
        others = statistics.median(med[r] for r in range(self.world) if r != rank)
        if others <= 0 or med[rank] <= (1 + self.threshold) * others:
            return None
        return {
            "rank": rank,
            "median_ms": round(med[rank], 3),
            "others_median_ms": round(others, 3),
            "slower_by": round(med[rank] / others - 1, 4),
        }

    def summary(self) -> dict:
        """For summary.json: each rank's median own time per step, and the slow rank (None if none)."""
        if not self.windows:
            return {}
        return {"step_ms_per_rank_median": [round(m, 3) for m in self.medians()], "slow_rank": self.slowest()}

    def live(self) -> str:
        """A short part for the live line ('' when no rank stands out)."""
        slow = self.slowest(self.RECENT)
        return describe(slow) if slow else ""


def rank_times(payload: list[float], watch: StragglerWatch) -> dict:
    """A window's metrics: each rank's own time per step, and the slow rank the live line names."""
    own = own_ms(payload, watch.world)
    if own is None:
        return {}
    watch.add(own)
    values: dict = {"rank_step_s": [round(v / 1e3, 6) for v in own]}  # seconds, as `dtlaunch report` reads it
    slow = watch.slowest(watch.RECENT)
    if slow is not None:
        values.update(slow_rank=slow["rank"], slow_rank_ms=slow["median_ms"], others_ms=slow["others_median_ms"])
    return values


def describe(slow: dict) -> str:
    return (
        f"slow rank {slow['rank']}: {slow['median_ms']:.1f} ms/step vs {slow['others_median_ms']:.1f} ms "
        f"(+{100 * slow['slower_by']:.0f}%)"
    )
