"""`dtlaunch debug RUN`: every rank's Python stacks of a live run, while rank 1 holds at a known step
(debug.hold_at_step) and rank 0 waits for it inside a collective."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_server import run_dtlaunch

HOLD = 3


def dtlaunch(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return run_dtlaunch([*args], env=env, **kw)


@pytest.mark.slow
def test_debug_prints_every_ranks_stack_of_a_held_run(trainer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*trainer.FAST, "training.steps=6", "training.sync_interval_s=0", "debug.fail_rank=1"]
    cmd = [sys.executable, "-m", "dtlaunch", "train", "recipe=tiny_ddp", *args, f"debug.hold_at_step={HOLD}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen(
        [*cmd, f"run.dir={run_dir}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        log = run_dir / "logs" / "rank1.log"
        deadline = time.monotonic() + 300
        while not (log.is_file() and f"holding at step {HOLD}" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        out = dtlaunch("debug", str(run_dir), timeout=120)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert "=== rank 0 (pid " in text and "=== rank 1 (pid " in text, text
        rank0, rank1 = text.split("=== rank 1")[0], text.split("=== rank 1")[1]
        assert "in maybe_fail" in rank1 and "in fit" in rank1, rank1  # faulthandler: "File ..., line N in f"
        assert "in fit" in rank0 and "in maybe_fail" not in rank0, rank0
        if shutil.which("py-spy"):
            spy = dtlaunch("debug", str(run_dir), "--py-spy", timeout=120)
            assert spy.returncode == 0, spy.stderr
            assert spy.stdout.count("=== rank ") == 2 and "maybe_fail" in spy.stdout, spy.stdout
        proc.send_signal(signal.SIGTERM)  # release the held rank: the run stops and saves (75)
        proc.communicate(timeout=300)
        assert proc.returncode == 1, proc.returncode  # checkpoints are off in FAST: stopped, nothing saved
    finally:
        if proc.poll() is None:
            proc.kill()
    # Not running any more: one line, exit 2.
    gone = dtlaunch("debug", str(run_dir))
    assert gone.returncode == 2 and "is not running" in gone.stderr, gone.stderr
