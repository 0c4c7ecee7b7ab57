"""torch.profiler around chosen training steps (profiling.*): one Chrome trace per rank and step.

The loop calls `profiled(step_fn, loader, ...)` once; with profiling off that returns the step function and
the loader themselves, so an unprofiled run does no extra work per step. With it on, a step far from the profiled ones costs one set
lookup; the warm-up steps before a profiled step (profiling.warmup) run the profiler without keeping the
events, so its start-up cost lands there and not in the profiled step.

Written per rank, under RUN/profile/step-<n>/:
- rank<r>.json.gz: the trace (Perfetto, chrome://tracing); the step is the span of the
  `dtlaunch.step` annotation and data loading that of `dtlaunch.data` (dtlaunch.report.breakdown reads them);
- rank<r>.timing.json: the step's wall time measured with a plain clock around the same span, so that the
  breakdown can be checked against a timer that is not the profiler's;
- rank<r>.memory.pickle (GPU, profiling.memory): the CUDA allocator's history (pytorch.org/memory_viz).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from dtlaunch.run.profile_files import DATA_ANNOTATION, PROFILE_DIR, STEP_ANNOTATION

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

MEMORY_HISTORY_ENTRIES = 100_000


def profiled_steps(pr: Any, total_steps: int) -> list[int]:
    """The steps profiling.steps and profiling.every name, within 1..total_steps, sorted."""
    chosen = {int(s) for s in pr.steps}
    every = int(pr.every)
    if every > 0:
        chosen.update(range(every, total_steps + 1, every))
    return sorted(s for s in chosen if 1 <= s <= total_steps)


def profiled(
    step_fn: Callable, loader: Any, cfg: JobConfig, run_dir: Path, rank: int, device: torch.device
) -> tuple[Callable, Any]:
    """`(step_fn, loader)` themselves when profiling is off. Else a function with step_fn's signature (the
    step number its last argument) that profiles the chosen steps, and the loader with its loading labelled
    for the trace (to be passed to that function in place of `loader`)."""
    if not bool(cfg.profiling.enabled):
        return step_fn, loader
    labelled = _LabelledLoader(loader) if loader is not None else None
    pr = cfg.profiling
    steps = profiled_steps(pr, int(cfg.training.steps))
    profiler = StepProfiler(step_fn, steps, int(pr.warmup), bool(pr.memory), run_dir, rank, device, labelled)
    return profiler, labelled


class _LabelledLoader:
    """The loader with each `next_batch` inside a `dtlaunch.data` annotation (the breakdown's data time);
    every other attribute is the loader's own."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self.active = False  # set by StepProfiler while a profiler runs: other steps pay nothing

    def next_batch(self) -> Any:
        if not self.active:
            return self._loader.next_batch()
        with record_function(DATA_ANNOTATION):
            return self._loader.next_batch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class StepProfiler:
    """Call it as the step function. A profiler runs from the first warm-up step of a group of consecutive
    profiled steps to the group's last step, and writes one trace per profiled step."""

    def __init__(
        self,
        step_fn: Callable,
        steps: list[int],
        warmup: int,
        memory: bool,
        run_dir: Path,
        rank: int,
        device: torch.device,
        loader: Any = None,
    ) -> None:
        self._step_fn = step_fn
        self._loader = loader
        self._profiled = set(steps)
        self._cuda = device.type == "cuda"
        self._memory = memory
        self._dir = Path(run_dir) / PROFILE_DIR
        self._rank = rank
        self._prof: Any = None
        self._step = 0  # the step being run (the trace callback names its files after it)
        self._measured: dict[int, float] = {}
        # Steps at which a profiler runs: each profiled step and the warm-up steps before it.
        self._touched = {s - k for s in steps for k in range(warmup + 1) if s - k >= 1}

    def __call__(self, *args: Any) -> Any:
        step = int(args[-1])
        if step not in self._touched:
            return self._step_fn(*args)
        if self._prof is None:
            self._start(step)
            if self._loader is not None:
                self._loader.active = True
        self._step = step
        with record_function(STEP_ANNOTATION):
            began = time.perf_counter()
            result = self._step_fn(*args)
            if self._cuda:
                torch.cuda.synchronize()  # the step's kernels inside its span, as the trace shows them
            self._measured[step] = time.perf_counter() - began
        self._prof.step()  # a profiled step ends here: its trace is written (see _write)
        if step + 1 not in self._touched:
            self._prof.stop()
            self._prof = None
            if self._loader is not None:
                self._loader.active = False
            if self._memory and self._cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
        return result

    def _start(self, first: int) -> None:
        def action(k: int) -> ProfilerAction:  # the profiler's k-th step is training step first + k
            step = first + k
            if step in self._profiled:
                return ProfilerAction.RECORD_AND_SAVE
            return ProfilerAction.WARMUP if step in self._touched else ProfilerAction.NONE

        # One trace per step is the point: torch's note that a new cycle drops the last one's events is noise.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=action,
            on_trace_ready=self._write,
            profile_memory=self._memory and not self._cuda,
        )
        if self._memory and self._cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._prof.start()

    def _write(self, prof: Any) -> None:
        out = self._dir / f"step-{self._step}"
        out.mkdir(parents=True, exist_ok=True)
        base = out / f"rank{self._rank}"
        tmp = base.with_suffix(".json.tmp")
        prof.export_chrome_trace(str(tmp))
        with tmp.open("rb") as src, gzip.open(f"{base}.json.gz", "wb", compresslevel=4) as dst:
            shutil.copyfileobj(src, dst)
        tmp.unlink()
        timing = {"step": self._step, "rank": self._rank, "measured_step_s": self._measured.get(self._step)}
        Path(f"{base}.timing.json").write_text(json.dumps(timing) + "\n")
        if self._memory and self._cuda:
            torch.cuda.memory._dump_snapshot(f"{base}.memory.pickle")


def oom_snapshot(run_dir: Path, rank: int) -> str | None:
    """After a CUDA out-of-memory error: the allocator's state (and history, where it was recorded) as
    RUN/profile/oom-rank<r>.pickle for pytorch.org/memory_viz; the path, or None without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    path = Path(run_dir) / PROFILE_DIR / f"oom-rank{rank}.pickle"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    except (OSError, RuntimeError):
        return None
    return os.fspath(path)
