"""Preemption through the CLI: SIGTERM / SIGUSR1 -> every rank stops at the same step boundary, saves that
step, and `dtlaunch train` exits 75 with one line; the same command again resumes with identical losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import worker_pid

STEPS = 30  # long enough that a signal sent after step 2 lands mid-run
COMMON = [
    f"training.steps={STEPS}",
    "training.seq_len=32",
    # No cadence saves: the only checkpoint before the end must be the preemption's.
    "checkpoint.every_steps=1000",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
]


def steps_logged(run_dir: Path) -> list[int]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    cmd = [sys.executable, "-m", "dtlaunch", "train", *COMMON, *overrides, f"run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(steps_logged(run_dir)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(
                f"run ended (rc {proc.returncode}) or stalled before step {step}:\n{out[-2000:]}\n{err[-2000:]}"
            )
        time.sleep(0.05)


def assert_preempted(proc: subprocess.Popen, run_dir: Path, signame: str) -> int:
    """rc 75, one stderr line naming the step; that step's checkpoint is complete; returns the step."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-2000:] + err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"preempted by {signame}: checkpoint saved at step" in lines[0], err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert 2 <= step < STEPS
    # Every rank stopped after the same step, and that step is the last one logged.
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"preempted by {signame} after step {step}: checkpoint saved" in log, log[-2000:]
    assert steps_logged(run_dir)[-1] == step
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "COMPLETE.json").is_file()
    assert not (run_dir / "checkpoints" / f"step-{STEPS:08d}").exists()
    return step


@pytest.mark.slow
def test_sigterm_to_cli_saves_exits_75_and_resumes_identically(trainer, tmp_path: Path) -> None:
    ref_dir = tmp_path / "ref"
    ref = trainer.cli(["train", "recipe=tiny_ddp", *COMMON, f"run.dir={ref_dir}"])
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir = tmp_path / "run"
    proc = start(run_dir, "recipe=tiny_ddp")
    wait_for_step(proc, run_dir, 2)
    from dtlaunch.commands.status import local_status

    # `dtlaunch status` of the live run: the launcher's pid, the step it is at.
    live = local_status(run_dir.resolve())
    assert live["state"] == "running" and live["pid"] == proc.pid and live["step"] >= 2, live
    assert live["total_steps"] == STEPS
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    step = assert_preempted(proc, run_dir, "SIGTERM")
    assert time.monotonic() - sent < 60
    stopped = local_status(run_dir.resolve())
    assert stopped["state"] == "preempted" and stopped["step"] == step, stopped
    assert stopped["newest_checkpoint"].endswith(f"step-{step:08d}"), stopped

    again = trainer.cli(["train", "recipe=tiny_ddp", *COMMON, f"run.dir={run_dir}"])
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-3000:]
    assert f"resumed from step-{step:08d}" in text
    assert f"[dtlaunch] loading checkpoint step-{step:08d}" in again.stdout  # the phase line
    done = local_status(run_dir.resolve())
    assert done["state"] == "finished" and done["step"] == done["total_steps"] == STEPS, done
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    reference = {r["step"]: r["loss"] for r in map(json.loads, (ref_dir / "metrics.jsonl").read_text().splitlines())}
    assert losses == reference  # bit-identical fp32, every step


@pytest.mark.slow
def test_sigusr1_to_one_worker_stops_every_rank_without_restart(tmp_path: Path) -> None:
    """Only rank 1 gets the signal; the all-reduce makes rank 0 stop too; max_restarts=1 must not restart."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "recipe=tiny_fsdp", "launch.max_restarts=1")
    wait_for_step(proc, run_dir, 2)
    pid = worker_pid(run_dir, 1)
    assert pid is not None, f"no worker of rank 1 for {run_dir}"
    os.kill(pid, signal.SIGUSR1)
    assert_preempted(proc, run_dir, "SIGUSR1")
    assert "attempt 1" not in (run_dir / "logs" / "rank0.log").read_text()
