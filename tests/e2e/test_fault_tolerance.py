"""Fault tolerance through the CLI: a worker that dies mid-run is restarted by torchrun and resumes.

A rank fails at a chosen step of the first attempt: SIGKILLed (`debug.fail_mode=sigkill`: no Python
error, exit -9) or by a Python exception (`raise`: torchrun's error file). With launch.max_restarts=1 the
workers restart, resume from the newest complete checkpoint and finish. metrics.jsonl is appended to by
every attempt, so steps after the resumed checkpoint appear twice; the last line of each step must equal
the uninterrupted run's loss bit for bit (fp32), and no line may be corrupt. This is the interrupted vs
uninterrupted check for DDP(2), ZeRO-3(2), TP(2) and PP(2), at kill points covering no checkpoint yet
(step 2), the step right after a checkpoint, and the last step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = 6
COMMON = [
    f"training.steps={STEPS}",
    "training.seq_len=32",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports on every attempt: nothing here reads its files
]


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every line must be one complete JSON record (a killed attempt may not leave a torn line)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_loss_per_step(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in metrics_rows(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    """Per-step losses of an uninterrupted run of a recipe (run once, on first use)."""

    def get(recipe: str) -> dict[int, float]:
        losses = last_loss_per_step(reference_run(f"recipe={recipe}", *COMMON))
        assert sorted(losses) == list(range(1, STEPS + 1))
        return losses

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "kill_step", "kill_rank", "mode"),
    [
        ("tiny_ddp", 2, 1, "sigkill"),  # before the first checkpoint: the restart starts from scratch
        ("tiny_ddp", 6, 1, "sigkill"),  # the last step
        ("tiny_fsdp", 3, 0, "sigkill"),  # right after the step-2 checkpoint; rank 0 (the metrics writer) dies
        ("tiny_fsdp", 5, 1, "raise"),
        ("tiny_tp", 4, 1, "sigkill"),
        ("tiny_pp", 5, 0, "raise"),
    ],
)
def test_failed_worker_restarts_and_matches(
    trainer, uninterrupted, tmp_path: Path, recipe: str, kill_step: int, kill_rank: int, mode: str
) -> None:
    run_dir = tmp_path / "run"
    proc = trainer.cli(
        [
            "train",
            f"recipe={recipe}",
            *COMMON,
            f"run.dir={run_dir}",
            f"debug.fail_at_step={kill_step}",
            f"debug.fail_rank={kill_rank}",
            f"debug.fail_mode={mode}",
            "launch.max_restarts=1",
            # One window per step whatever the step time, so which lines attempt 0 wrote is exact below.
            "training.sync_interval_s=0",
        ]
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    # The kill really happened and the group really restarted (attempt 1 logged by every rank).
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank}, attempt 1" in log, log[-2000:]
    resumed_from = 2 * ((kill_step - 1) // 2)  # newest complete checkpoint before the killed step
    if resumed_from:
        assert f"resumed from step-{resumed_from:08d}" in text, text[-3000:]
    else:
        assert "resumed from" not in text
    rows = metrics_rows(run_dir)
    # A step's line is written when its window of outcomes is read, one step later at log_every=1
    # (dtlaunch.train.step_sync), and at once on a checkpointed step; so attempt 0 logged up to the step
    # before the killed one's predecessor, or up to its checkpoint. Attempt 1 logged resumed_from+1..STEPS.
    logged = max(resumed_from, kill_step - 2)
    assert [r["step"] for r in rows] == list(range(1, logged + 1)) + list(range(resumed_from + 1, STEPS + 1))
    # Bit-identical fp32 losses: exact equality, not a tolerance.
    assert last_loss_per_step(run_dir) == uninterrupted(recipe)
    assert (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE.json").is_file()


# ---------------------------------------------------------------------------------------------
# Guards: a run that keeps producing non-finite steps stops; a stuck rank is named, not waited on forever.


def one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_bad_steps_in_a_row_stop_the_run(trainer, tmp_path: Path) -> None:
    """NaN loss at steps 2 and 3 with max_bad_steps=2: both skipped and counted, then exit 1 with one line."""
    run_dir = tmp_path / "run"
    proc = trainer.run(
        run_dir, "recipe=tiny_ddp", "debug.nan_at_steps=[2,3]", "training.max_bad_steps=2", expect_ok=False
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc)
    assert "2 steps in a row with a non-finite loss or gradient norm (last at step 3)" in line, line
    assert "training.max_bad_steps" in line
    rows = metrics_rows(run_dir)
    assert [(r["step"], r["skipped"]) for r in rows] == [(1, 0), (2, 1), (3, 1)]


@pytest.mark.slow
def test_stuck_rank_is_named_after_the_collective_timeout(trainer, tmp_path: Path) -> None:
    """Rank 1 stops at step 3; rank 0's collective gives up after launch.timeout_s and names rank 1, the
    collective, and the flight records both ranks dumped; torch's analyser finds rank 1 missing in them."""
    import subprocess
    import sys
    import time

    timeout_s = 10
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = trainer.run(
        run_dir,
        "recipe=tiny_ddp",
        "debug.hang_at_step=3",
        "debug.fail_rank=1",
        f"launch.timeout_s={timeout_s}",
        expect_ok=False,
    )
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc)
    assert f"a collective at step 3 waited longer than launch.timeout_s={timeout_s}s (all_reduce #" in line, line
    assert "did not arrive: rank 1 (last at step 2)" in line, line
    records = run_dir / "flight_recorder"
    assert f"flight records of 2/2 ranks in {records}: torchfrtrace {records}" in line, line
    assert sorted(p.name for p in records.iterdir()) == ["rank_0", "rank_1"]
    # The printed command, run as printed (the console script next to this interpreter).
    tool = Path(sys.executable).parent / "torchfrtrace"
    cmd = (
        [str(tool), str(records)]
        if tool.is_file()
        else [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(records)]
    )
    analysis = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    report = analysis.stdout + analysis.stderr  # the analyser logs its findings
    assert "missing ranks: {1}" in report and "collective: gloo:all_reduce" in report, report[-3000:]
    # Bounded: start-up plus the timeout plus the teardown, not a hang (measured ~15 s + 10 s + 5 s here).
    assert took < 150, took


@pytest.mark.slow
def test_slow_rank_is_named_in_the_summary(trainer, tmp_path: Path) -> None:
    """Rank 1 sleeps 0.2 s in every step (debug.slow_step_s): rank 0 waits for it in each step's
    collective, and the end summary names rank 1 with its median against the other's."""
    run_dir = tmp_path / "run"
    proc = trainer.run(
        run_dir,
        "recipe=tiny_ddp",
        "training.steps=8",
        "training.sync_interval_s=0",
        "debug.slow_step_s=0.2",
        "debug.fail_rank=1",
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["slow_rank"]["rank"] == 1, summary
    assert summary["slow_rank"]["slower_by"] > 0.1, summary
    assert "slow rank    rank 1: " in proc.stdout and "ms on the other ranks" in proc.stdout, proc.stdout[-2000:]
    rows = metrics_rows(run_dir)
    assert all(len(r["rank_step_s"]) == 2 for r in rows if "rank_step_s" in r)
    assert any(r.get("slow_rank") == 1 for r in rows)  # the live line named it as well
