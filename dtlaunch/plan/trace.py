"""Traced second opinion on the memory plan (`dtlaunch plan --trace`, and the plan of a model without a
closed-form memory model): one rank of the job's world traced in this process by the worker's own runtime
and train_step (dtlaunch.train.memory_trace, the planner's one entry point into the worker's code).

Real CPU tensors when the run is small enough, else fake tensors (shapes and dtypes, no storage).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.config.layout import Layout
from dtlaunch.errors import ConfigError
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.stage import plan_stages

# Above this analytic per-rank peak the trace uses fake tensors instead of real CPU ones.
REAL_TENSOR_LIMIT = 4 * 1024**3
# Pipeline schedules whose order the trace replays on one stage (dtlaunch.train.memory_trace.PP_ORDERS).
TRACEABLE_SCHEDULES = ("1f1b", "gpipe")


def trace_peak(cfg: Any, layout: Layout, rank: int = 0, steps: int = 2, fake: bool | None = None) -> dict:
    """{"peak_bytes", "categories" (bytes at the peak), "rank", "stage", "tensors": "real"|"fake"}.

    fake=None: real CPU tensors when the analytic peak is under REAL_TENSOR_LIMIT (this emulation
    reproduced real gloo runs' MemTracker peaks to 0.01 %), fake tensors above (fake and real traces
    of the same run agree within 3 %: tests/unit/test_plan_trace.py)."""
    if fake is None:
        fake = traced_with_fake_tensors(cfg, layout)
    if layout.pp > 1 and (layout.tp > 1 or cfg.strategy.pp_schedule not in TRACEABLE_SCHEDULES):
        raise ConfigError(
            f"--trace replays only 1F1B and GPipe pipelines without TP (got strategy.pp_schedule="
            f"{cfg.strategy.pp_schedule}, strategy.tp={layout.tp}): drop --trace, or check the plan with a real run"
        )
    from dtlaunch.train.memory_trace import trace_rank

    return trace_rank(cfg, layout, rank, steps, fake)


def traced_with_fake_tensors(cfg: Any, layout: Layout) -> bool:
    """Fake tensors when the analytic peak is over REAL_TENSOR_LIMIT. A model without a closed-form plan:
    fake tensors (no storage) where the runtime's path supports them (FSDP); DDP and single-process
    layouts swap parameters in place when materialising, which fake tensors refuse: real tensors there."""
    if not model_spec(cfg.model).analytic:
        return int(cfg.strategy.zero_stage) >= 2 and layout.dp > 1
    return max(s.peak for s in plan_stages(cfg, layout, all_stages=False)) > REAL_TENSOR_LIMIT
