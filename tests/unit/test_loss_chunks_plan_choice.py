"""training.loss_chunks=auto on a GPU profile: the plan takes one full-vocabulary pass wherever it fits (the
chunks cost up to 9 % of a step on an H200, bench/gpu) and the chunks only where it does not; the launcher
and `submit` write that choice into the job the workers read. The CPU profile and an explicit count keep
the job's own decision (config.decisions)."""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.commands.plan import take_plan_choices
from dtlaunch.plan.memory import GIB, plan_memory

# planner7m with a 128k vocabulary: 4 x 128 tokens x 131,072 = 64 Mi logits, which auto chunks (8).
BIG_VOCAB = ["model=planner7m", "model.vocab_size=131072", "training.micro_batch=4", "training.seq_len=128"]


def _plan(*overrides: str):
    job = load_job([*BIG_VOCAB, *overrides])
    return job, plan_memory(job.cfg, job.layout)


def test_the_full_pass_where_it_fits_on_a_gpu_profile() -> None:
    job, plan = _plan("hardware=h100_80gb")
    _, full = _plan("hardware=h100_80gb", "training.loss_chunks=1")
    _, chunked = _plan("hardware=h100_80gb", "training.loss_chunks=8")
    assert job.decisions.loss_chunks == 8 and plan.loss_chunks == 1 and plan.to_dict()["loss_chunks"] == 1
    assert plan.peak == full.peak > chunked.peak  # the full pass's plan, which holds the logits
    assert any("training.loss_chunks=auto: one full-vocabulary pass" in n for n in plan.notes), plan.notes
    take_plan_choices(job, plan)  # what the launcher writes into the run's config.yaml
    assert int(job.cfg.training.loss_chunks) == 1 and job.decisions.loss_chunks == 1


def test_the_chunks_where_only_they_fit() -> None:
    _, full = _plan("hardware=h100_80gb", "training.loss_chunks=1")
    _, chunked = _plan("hardware=h100_80gb", "training.loss_chunks=8")
    # A card between the two: the full pass does not fit on it, the chunked loss does.
    between = (full.device_total + chunked.device_total) / 2 / GIB
    job, plan = _plan("hardware=h100_80gb", f"hardware.memory_gib={between}")
    assert plan.fits and plan.loss_chunks == 0 and plan.peak == chunked.peak
    assert "loss_chunks" not in plan.to_dict()
    take_plan_choices(job, plan)
    assert int(job.cfg.training.loss_chunks) == 0 and job.decisions.loss_chunks == 8  # the job's own auto


@pytest.mark.parametrize("overrides", [["hardware=cpu"], ["hardware=h100_80gb", "training.loss_chunks=8"]])
def test_the_cpu_profile_and_an_explicit_count_keep_the_jobs_own(overrides: list[str]) -> None:
    _, plan = _plan(*overrides)
    _, chunked = _plan(*overrides[:1], "training.loss_chunks=8")
    assert plan.loss_chunks == 0 and plan.peak == chunked.peak


def test_submit_writes_the_plans_choice_into_the_job(capsys) -> None:
    """`submit`'s nodes run torchrun on the run directory's config.yaml: the plan's choice must be in it."""
    from dtlaunch.commands.submit import _plan_gate

    job = load_job([*BIG_VOCAB, "hardware=h100_80gb", "cluster=slurm"])
    _plan_gate(job, force=False, to_stderr=True)
    assert int(job.cfg.training.loss_chunks) == 1 and job.decisions.loss_chunks == 1
    assert "one full-vocabulary pass" in capsys.readouterr().err
