"""Through the CLI as a user runs it: a checkpoint whose `.metadata` is garbage of the right size is
detected by its checksum and the run resumes from the older intact step (the launcher says which and
why); a bad input a worker finds is reported with exit 2 and its message, not as a worker crash."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# The same run test_resume_cli.py compares with (session cache: no extra launch in the full suite).
ARGS = [
    "recipe=tiny_fsdp",
    "training.micro_batch=2",
    "training.global_batch=4",
    "training.seq_len=32",
    "training.steps=6",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=3",
    "training.loss_plot=false",
]


@pytest.mark.slow
def test_garbage_metadata_falls_back_and_worker_input_error_exits_2(reference_run, trainer, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference_run(*ARGS), run)
    meta = run / "checkpoints" / "step-00000006" / ".metadata"
    size = meta.stat().st_size
    meta.write_bytes(bytes((b + 1) % 256 for b in meta.read_bytes()))
    assert meta.stat().st_size == size
    # Resume, then a worker finds "bad input" at step 5 (fault injection standing in for data that only
    # a worker can read wrong).
    proc = trainer.cli(["train", *ARGS, f"run.dir={run}", "debug.fail_at_step=5", "debug.fail_mode=input"])
    out = proc.stdout + proc.stderr
    assert "skipping checkpoint step-00000006: file .metadata is corrupt" in proc.stdout, out[-3000:]
    assert "resuming from step-00000003" in proc.stdout, out[-3000:]
    assert "resumed from step-00000003" in proc.stdout, out[-3000:]
    assert proc.returncode == 2, out[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert err[-1] == "dtlaunch: error: injected input error at step 5 (debug.fail_at_step)", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
