"""`python -m dtlaunch.commands.eval_job RUN` (the Slurm evaluation job's command) on a run whose training did
not finish: one line and exit 2, nothing evaluated; the job must never score a half-trained model when it
is started without its dependency on the training job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def test_unfinished_run_is_refused(tiny_eval_inputs, tmp_path: Path) -> None:
    overrides, _ = tiny_eval_inputs
    run_dir = tmp_path / "run"
    train = run(
        "-m",
        "dtlaunch",
        "train",
        "recipe=tiny_ddp",
        *overrides,
        "training.eval_tasks=[tiny_mc]",
        "training.steps=3",
        "checkpoint.every_steps=1",
        "debug.fail_at_step=3",  # fails after the checkpoint of step 2
        f"run.dir={run_dir}",
    )
    assert train.returncode != 0 and (run_dir / "checkpoints" / "step-00000002").is_dir(), train.stderr[-2000:]
    res = run("-m", "dtlaunch.commands.eval_job", str(run_dir))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(lines) == 1 and "newest checkpoint" in lines[0] and "step 2 of training.steps=3" in lines[0], lines
    assert not (run_dir / "eval").exists()
