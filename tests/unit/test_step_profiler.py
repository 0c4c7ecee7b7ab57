"""dtlaunch.train.observe.profiling in one process: which steps get a trace, what a trace holds, and that with
profiling off the loop gets its own step function back (no wrapper, no per-step work)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from dtlaunch.report.breakdown import breakdown, load_events
from dtlaunch.train.batch import MicroBatch
from dtlaunch.train.observe.profiling import profiled


class _Loader:
    def __init__(self) -> None:
        self.batches = 0
        self.consumed = 0

    def next_batch(self) -> MicroBatch:
        self.batches += 1
        return MicroBatch(torch.randn(64, 64), torch.randn(64, 64))


def _step(ctx, step: int) -> torch.Tensor:
    batch = ctx.loader.next_batch()
    return (batch.inputs @ batch.targets).relu().sum()


def _cfg(enabled: bool) -> object:
    pr = {"enabled": enabled, "steps": [2], "every": 3, "warmup": 1, "memory": True}
    return OmegaConf.create({"profiling": pr, "training": {"steps": 7}})


def test_profiling_off_returns_the_step_function_itself(tmp_path: Path) -> None:
    loader = _Loader()
    fn, got = profiled(_step, loader, _cfg(False), tmp_path, 0, torch.device("cpu"))
    assert fn is _step and got is loader
    assert not (tmp_path / "profile").exists()


def test_the_chosen_steps_get_one_trace_each(tmp_path: Path) -> None:
    loader = _Loader()
    fn, labelled = profiled(_step, loader, _cfg(True), tmp_path, 3, torch.device("cpu"))
    ctx = SimpleNamespace(loader=labelled)
    results = [fn(ctx, s) for s in range(1, 8)]
    assert all(isinstance(r, torch.Tensor) for r in results)
    assert loader.batches == 7 and labelled.consumed == 0  # the loader's own attributes
    # steps=[2] plus every 3rd of 7 steps; warm-up steps (1, 5) keep nothing.
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step-2", "step-3", "step-6"]
    for n in (2, 3, 6):
        trace = tmp_path / "profile" / f"step-{n}" / "rank3.json.gz"
        with gzip.open(trace, "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {"dtlaunch.step", "dtlaunch.data", "aten::mm"} <= names
        assert "[memory]" in names  # profiling.memory on CPU: the profiler's memory events
        got = breakdown(load_events(trace))
        assert got["compute"] > 0 and got["data"] > 0 and got["comm_exposed"] == 0
        timing = json.loads(trace.with_name("rank3.timing.json").read_text())
        assert timing["step"] == n and 0 < timing["measured_step_s"] < 10
