"""A run directory has one owner: the workers die with their launcher, and a second launcher is refused.

torchrun starts every worker in a session of its own, so killing the launcher's process group (the OOM
killer, `kill -9`, a lost terminal) used to leave the workers training, saving and pruning checkpoints
under a restarted launcher. Rank 1 holds at a step (debug.hold_at_step) so the run is alive, mid-training,
for as long as the test needs it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import run_workers
from test_preemption import wait_until_held

ARGS = [
    "recipe=tiny_ddp",
    "training.steps=6",
    "training.seq_len=32",
    "checkpoint.every_steps=2",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports: nothing here reads its files
    "training.sync_interval_s=0",
]


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    """`dtlaunch train` in a process group of its own, as a terminal starts it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    cmd = [sys.executable, "-m", "dtlaunch", "train", *ARGS, *extra, f"run.dir={run_dir}"]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.slow
def test_second_launcher_refused_workers_die_with_a_killed_launcher_restart_resumes(tmp_path: Path) -> None:
    run_dir = (tmp_path / "run").resolve()
    first = launch(run_dir, "debug.hold_at_step=3", "debug.fail_rank=1")
    wait_until_held(first, run_dir, 3)
    assert len(run_workers(run_dir)) == 2

    second = subprocess.run(
        [sys.executable, "-m", "dtlaunch", "train", *ARGS, f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COLUMNS="200"),
    )
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert len(lines) == 1, second.stderr
    assert f"is in use by another `dtlaunch train` (pid {first.pid} on host {socket.gethostname()})" in lines[0]

    os.killpg(first.pid, signal.SIGKILL)  # the launcher and everything in its process group
    first.wait(timeout=30)
    died = time.monotonic()
    while run_workers(run_dir) and time.monotonic() - died < 2:
        time.sleep(0.05)
    orphans = run_workers(run_dir)
    for pid in orphans:  # not left behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"workers {orphans} outlived their launcher by 2 s"

    # The dead launcher's lock went with it: the same command starts, resumes the step-2 checkpoint, finishes.
    again = subprocess.run(
        [sys.executable, "-m", "dtlaunch", "train", *ARGS, f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resumed from step-00000002" in again.stdout + again.stderr
