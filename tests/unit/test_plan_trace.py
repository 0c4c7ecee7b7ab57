"""The traced second opinion (dtlaunch/plan/trace.py) against the analytic plan and a known real run."""

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.plan.memory import plan_memory

BASE = ["model=planner7m", "training.micro_batch=2", "training.seq_len=128", "hardware=cpu"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=zero3", "launch.nproc_per_node=8", "precision=bf16"],
        ["strategy=fsdp_tp", "launch.nproc_per_node=8", "training.activation_checkpointing=full"],
        ["strategy=ddp", "launch.nproc_per_node=4", "precision=bf16"],
    ],
)
def test_analytic_within_5_percent_of_trace(overrides):
    from dtlaunch.plan.trace import trace_peak

    job = load_job([*BASE, *overrides])
    traced = trace_peak(job.cfg, job.layout, steps=3)
    assert traced["tensors"] == "real"
    predicted = plan_memory(job.cfg, job.layout).peak
    assert abs(predicted - traced["peak_bytes"]) / traced["peak_bytes"] <= 0.05, (predicted, traced)


def test_trace_refuses_pipeline_layouts():
    from dtlaunch.plan.trace import trace_peak

    job = load_job([*BASE, "strategy=pp", "launch.nproc_per_node=2"])
    with pytest.raises(ConfigError, match="strategy.pp=2"):
        trace_peak(job.cfg, job.layout)
