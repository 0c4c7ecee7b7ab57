"""Preemption through the CLI: SIGTERM / SIGUSR1 -> every rank stops at the same step boundary, saves that
step, and `dtlaunch train` exits 75 with one line; the same command again resumes with identical losses.

No test signals a run by watching its progress (a fast machine finishes first, a slow one is signalled
before it started): rank `debug.fail_rank` holds at `debug.hold_at_step` until the signal arrives, and one
collective per step (training.sync_interval_s=0) makes the step every rank stops after exact.
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
from processes import worker_pid

STEPS = 30
HOLD = 4  # rank 1 waits at the start of this step for the signal
COMMON = [
    f"training.steps={STEPS}",
    "training.seq_len=32",
    # No cadence saves: the only checkpoint before the end must be the preemption's.
    "checkpoint.every_steps=1000",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports: nothing here reads its files
    "training.sync_interval_s=0",
]
# The signal reaches the held rank before its step HOLD; the flag rides on that step's collective, which
# every rank reads one step later: all stop after HOLD + 1.
STOP = HOLD + 1


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


def wait_until_held(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    """Until rank 1 logs that it holds at `step` (debug.hold_at_step)."""
    deadline = time.monotonic() + timeout
    log = run_dir / "logs" / "rank1.log"
    while not (log.is_file() and f"holding at step {step} (debug.hold_at_step)" in log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(
                f"run ended (rc {proc.returncode}) or stalled before step {step}:\n{out[-2000:]}\n{err[-2000:]}"
            )
        time.sleep(0.05)


def held(run_dir: Path, *overrides: str, step: int = HOLD) -> subprocess.Popen:
    """A run whose rank 1 holds at `step`, waited for."""
    proc = start(run_dir, *overrides, f"debug.hold_at_step={step}", "debug.fail_rank=1")
    wait_until_held(proc, run_dir, step)
    return proc


def assert_preempted(proc: subprocess.Popen, run_dir: Path, signame: str) -> int:
    """rc 75, one stderr line naming the step; that step's checkpoint is complete; returns the step."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-2000:] + err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"preempted by {signame}: checkpoint saved at step" in lines[0], err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert step == STOP
    # Every rank stopped after the same step, and that step is the last one logged.
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"preempted by {signame} after step {step}: checkpoint saved" in log, log[-2000:]
    assert steps_logged(run_dir)[-1] == step
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "COMPLETE.json").is_file()
    assert not (run_dir / "checkpoints" / f"step-{STEPS:08d}").exists()
    return step


@pytest.fixture(scope="module")
def signalled_after_the_last_step(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A tiny_ddp run whose rank 1 holds after the last step (while the final checkpoint is written) and
    whose launcher is SIGTERMed there: a finished run, so also the uninterrupted reference that a
    preempted and resumed run must match (one launch for both tests)."""
    run_dir = tmp_path_factory.mktemp("last_step") / "run"
    proc = held(run_dir, "recipe=tiny_ddp", step=STEPS + 1)  # STEPS + 1 = after the last step
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return run_dir, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_sigterm_to_cli_saves_exits_75_and_resumes_identically(
    trainer, signalled_after_the_last_step, tmp_path: Path
) -> None:
    ref_dir, ref = signalled_after_the_last_step
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir = tmp_path / "run"
    proc = held(run_dir, "recipe=tiny_ddp")
    from dtlaunch.commands.status import local_status

    # `dtlaunch status` of the live run: the launcher's pid, the step it is at. Rank 0 logs step HOLD - 2
    # once its step HOLD - 1 is done, which the held rank does not prevent.
    deadline = time.monotonic() + 120
    while (local_status(run_dir.resolve())["step"] or 0) < HOLD - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    live = local_status(run_dir.resolve())
    assert live["state"] == "running" and live["pid"] == proc.pid and live["step"] == HOLD - 2, live
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
    proc = held(run_dir, "recipe=tiny_fsdp", "launch.max_restarts=1")
    pid = worker_pid(run_dir, 1)
    assert pid is not None, f"no worker of rank 1 for {run_dir}"
    os.kill(pid, signal.SIGUSR1)
    assert_preempted(proc, run_dir, "SIGUSR1")
    assert "attempt 1" not in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_sigterm_after_the_last_step_is_a_finished_run(signalled_after_the_last_step) -> None:
    """The signal lands while the final checkpoint is being written: the run is complete, exit 0."""
    run_dir, proc = signalled_after_the_last_step
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "run finished" in out and "SIGTERM" not in out + err, out[-2000:] + err[-2000:]
    assert (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE.json").is_file()
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
