"""Planned vs measured device and host bytes under offloading on real 2-process gloo runs: a CI-sized subset
of bench/offload_accuracy.py (whose module docstring says what a CPU run can and cannot show)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "offload_accuracy.py"
SUBSET = [
    ["strategy=zero3", "launch.nproc_per_node=2", "training.activation_offload=true", "precision=bf16"],
    [
        "strategy=zero3",
        "launch.nproc_per_node=2",
        "strategy.cpu_offload=true",
        "training.activation_offload=true",
        "training.global_batch=16",
    ],
]


@pytest.mark.slow
@pytest.mark.slow_reason("real runs with CPU offload, their measured peaks against the plan")
def test_offloaded_plan_matches_real_runs() -> None:
    spec = importlib.util.spec_from_file_location("offload_accuracy", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for row in bench.run(SUBSET):
        assert row["host"] > 0 and row["device"] > 0, row
        assert abs(row["planned_host"] - row["host"]) <= 0.01 * row["host"], row
        assert abs(row["planned_device"] - row["device"]) <= 0.08 * row["device"], row


@pytest.mark.slow
def test_one_rank_cpu_offload_plan_matches_a_real_run() -> None:
    """ZeRO-Offload on one rank: the parameters, gradients and AdamW state are all host lines."""
    spec = importlib.util.spec_from_file_location("offload_accuracy", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.run([bench.ONE_RANK_RUNS[0]], world=1)
    assert row["host"] > 0 and row["device"] > 0, row
    assert abs(row["planned_host"] - row["host"]) <= 0.01 * row["host"], row
    assert abs(row["planned_device"] - row["device"]) <= 0.08 * row["device"], row
