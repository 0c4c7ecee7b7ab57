"""Analytic peak vs a measured one (MemTracker, rank 0 of a fake-PG world on real CPU tensors)."""

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.memory import plan_memory

CASES = [
    ("ddp", 1, "fp32", "none"),
    ("ddp", 2, "fp32", "none"),
    ("zero3", 2, "fp32", "none"),
    ("zero3", 2, "fp32", "selective"),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world,precision,ac", CASES)
def test_predicted_peak_within_3_percent(strategy, world, precision, ac):
    from dtlaunch.plan.measure import measure_peak

    job = load_job(
        [
            "model=small",
            f"strategy={strategy}",
            f"precision={precision}",
            f"launch.nproc_per_node={world}",
            "training.micro_batch=4",
            "training.seq_len=128",
            f"training.activation_checkpointing={ac}",
        ]
    )
    predicted = plan_memory(job.cfg, job.layout).peak
    # The untracked warm-up step creates the optimizer state; every step after it is the same steady
    # state, so one tracked step gives the peak three do (zero3: 103,847,692 bytes either way).
    measured = measure_peak(job.cfg, world, steps=2)
    assert abs(predicted - measured) / measured <= 0.03, (predicted, measured)
