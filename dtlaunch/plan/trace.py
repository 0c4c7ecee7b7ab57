"""Traced second opinion on the memory plan (`dtlaunch plan --trace`, and the plan of a model without a
closed-form memory model): one rank of the job's world traced in this process by the worker's own runtime
and train_step (dtlaunch.train.features.memory_trace, the planner's one entry point into the worker's code).

Real CPU tensors when the run is small enough, else fake tensors (shapes and dtypes, no storage).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dtlaunch.config.layout import Layout
from dtlaunch.errors import ConfigError
from dtlaunch.models.registry import model_spec, routed_experts
from dtlaunch.plan.stage import plan_stages

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Above this analytic per-rank peak the trace uses fake tensors instead of real CPU ones.
REAL_TENSOR_LIMIT = 4 * 1024**3
# Pipeline schedules whose order the trace replays on one stage (dtlaunch.train.features.memory_trace.PP_ORDERS).
TRACEABLE_SCHEDULES = ("1f1b", "gpipe")


def trace_peak(cfg: JobConfig, layout: Layout, rank: int = 0, steps: int = 2, fake: bool | None = None) -> dict:
    """{"peak_bytes", "categories" (bytes at the peak), "rank", "stage", "tensors": "real"|"fake"}.

    fake=None: real CPU tensors when the analytic peak is under REAL_TENSOR_LIMIT (this emulation
    reproduced real gloo runs' MemTracker peaks to 0.01 %), fake tensors above (fake and real traces
    of the same run agree within 3 %: tests/unit/test_plan_trace.py). A job that cannot be traced here
    (`skip_reason`) is a ConfigError naming why."""
    if fake is None:
        fake = traced_with_fake_tensors(cfg, layout)
    if fake and real_tensors_needed(cfg, layout):
        fake = False
    reason = skip_reason(cfg, layout, fake)
    if reason:
        raise ConfigError(f"--trace: {reason}")
    from dtlaunch.train.features.memory_trace import trace_rank

    return trace_rank(cfg, layout, rank, steps, fake)


def skip_reason(cfg: JobConfig, layout: Layout, fake: bool | None = None) -> str | None:
    """Why this job's trace cannot run in this process (None when it can): a pipeline schedule the
    trace does not replay, or real tensors needed (see real_tensors_needed) beyond this machine's
    free memory. `plan --trace` prints it in one line next to the analytic plan."""
    if layout.pp > 1 and cfg.strategy.pp_schedule not in TRACEABLE_SCHEDULES:
        return (
            f"the trace replays only 1F1B and GPipe pipelines (strategy.pp_schedule={cfg.strategy.pp_schedule}); "
            "check this plan with a real run"
        )
    if fake is None:
        fake = traced_with_fake_tensors(cfg, layout)
    why_real = real_tensors_needed(cfg, layout)
    if not fake or why_real:
        need = _analytic_bytes(cfg, layout)
        free = free_host_bytes()
        if need is not None and need > free:
            because = f" ({why_real})" if why_real else ""
            bound = "" if model_spec(cfg.model).analytic else "at least "  # its weights alone: _analytic_bytes
            return (
                f"this job traces on real tensors{because}: {bound}{need / 1024**3:.1f} GiB needed, "
                f"{free / 1024**3:.1f} GiB free on this machine; check this plan with a real run or on a larger host"
            )
    return None


def real_tensors_needed(cfg: JobConfig, layout: Layout) -> str | None:
    """Why fake tensors cannot trace this job (None when they can)."""
    if int(cfg.strategy.zero_stage) <= 1 and layout.dp > 1:
        return "DDP's reducer allocates its buckets outside the dispatcher"
    if routed_experts(cfg.model):
        return "a MoE router's token counts size the expert matmuls, and fake tensors hold no values"
    return None


def free_host_bytes() -> int:
    """Memory this process can still take: MemAvailable on Linux, free pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def weights_lower_bound(cfg: JobConfig, layout: Layout) -> float:
    """The least a rank holds of a model without a closed-form plan: its fp32 weights (the runtime keeps
    fp32 parameters, as the plan's parameters line counts them) spread over every rank."""
    return 4.0 * model_spec(cfg.model).param_count(cfg.model) / max(1, layout.world)


def _analytic_bytes(cfg: JobConfig, layout: Layout) -> float | None:
    """The traced rank's analytic bytes, device and host (the trace holds both in one memory). A model
    without a closed-form plan: a lower bound, its fp32 weights spread over every rank (a published 80B
    MoE would otherwise be materialised on this host before anything could say it does not fit)."""
    if not model_spec(cfg.model).analytic:
        return weights_lower_bound(cfg, layout)
    return max(s.peak + s.host_peak for s in plan_stages(cfg, layout, all_stages=False))


def traced_with_fake_tensors(cfg: JobConfig, layout: Layout) -> bool:
    """Fake tensors when the analytic peak is over REAL_TENSOR_LIMIT. A model without a closed-form plan:
    fake tensors (no storage) where the runtime's path supports them (FSDP); DDP and single-process
    layouts of such a model are traced on real tensors."""
    if not model_spec(cfg.model).analytic:
        return int(cfg.strategy.zero_stage) >= 2 and layout.dp > 1
    return max(s.peak for s in plan_stages(cfg, layout, all_stages=False)) > REAL_TENSOR_LIMIT
