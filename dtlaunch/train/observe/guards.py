"""Collective-timeout guard: name the ranks that never reached the step a collective timed out in.

gloo reports a timed-out collective as "Timed out waiting Nms for recv ..." without saying which peer is
missing. Each rank therefore records the step it has entered in the rendezvous store; when a collective times out, the rank that saw it reads the others' records and raises one line that
names the ranks still behind. With NCCL the watchdog aborts the process instead of raising, so there only
torch's own message (and the logs) remain.

The record is written by a heartbeat thread a few times a second, not by the loop: a store `set` is a
round trip to the launcher's TCP store, which every step would pay for. A collective times out only
after launch.timeout_s (seconds), long after the heartbeat has written the step a rank reached.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from dtlaunch.errors import EXIT_WORKER_FAILED, DtlaunchError

_KEY = "dtlaunch/reached/"


class CollectiveTimeout(DtlaunchError):
    exit_code = EXIT_WORKER_FAILED


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _default_store() -> Optional[Any]:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):  # private API: without it the error just names no rank
        return None


class StepWatch:
    """`with watch.step(n):` around each step's collectives: records progress, translates a timeout."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.store = _default_store()
        self._step = -1  # the step this rank has entered; the heartbeat thread publishes it
        self._written = -1
        if self.store is not None:
            threading.Thread(target=self._beat, name="dtlaunch-stepwatch", daemon=True).start()

    def reached(self, step: int) -> None:
        self._step = step

    def _beat(self, period_s: float = 0.2) -> None:
        while True:
            step = self._step
            if step != self._written:
                try:
                    self.store.set(f"{_KEY}{self.rank}", str(step))  # TCPStore's client is thread-safe
                except (RuntimeError, ValueError, OSError):
                    return  # the store is gone (shutdown): nothing left to record
                self._written = step
            time.sleep(period_s)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        self.reached(step)
        try:
            yield
        except Exception as exc:
            if is_timeout(exc):
                raise self.explain(step, exc) from exc
            raise

    def behind(self, step: int) -> dict[int, int]:
        """Ranks whose last recorded step is before `step` -> that step (-1: never recorded one)."""
        if self.store is None:
            return {}
        late = {}
        for r in range(self.world):
            key = f"{_KEY}{r}"
            try:
                last = int(self.store.get(key)) if self.store.check([key]) else -1
            except (RuntimeError, ValueError):
                continue  # the store itself is gone: say nothing rather than guess
            if last < step:
                late[r] = last
        return late

    def explain(self, step: int, exc: BaseException) -> CollectiveTimeout:
        late = self.behind(step)
        where = f"a collective at step {step} waited longer than launch.timeout_s={self.timeout_s:g}s"
        if late:
            who = ", ".join(
                f"rank {r} (last at step {s})" if s >= 0 else f"rank {r} (no step yet)" for r, s in late.items()
            )
            return CollectiveTimeout(f"{where}: did not arrive: {who}; see logs/rank{next(iter(late))}.log")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CollectiveTimeout(f"{where}: every rank reached the step, one is stuck inside it ({first})")
