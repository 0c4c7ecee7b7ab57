"""training.eval_tasks on a job `dtlaunch submit` sent to a real Slurm (the slurm_cluster fixture): the job
evaluates its final checkpoint once, after the workers, into RUN/eval/<time>.json, with the scores
`dtlaunch eval RUN` gives on the same run; a bad task name is refused (exit 2, one line) before anything
is submitted. Offline: one multiple-choice task of our own over local JSONL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.slow]
pytest.importorskip("lm_eval")

STEPS = 3


def dtlaunch(env: dict, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dtlaunch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def inputs(tiny_eval_inputs) -> tuple[list[str], Path]:
    """The job's overrides and the task directory (tests/conftest.py: tiny_eval_inputs)."""
    overrides, tasks = tiny_eval_inputs
    job = ["recipe=tiny_ddp", "cluster=slurm", "cluster.nodes=1", "cluster.time=00:10:00"]
    return [*job, *overrides, f"training.steps={STEPS}", f"checkpoint.every_steps={STEPS}"], tasks


def wait_finished(cluster, job_id: str, run_dir: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = cluster.job_field(job_id, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("slurm-*")))
    raise AssertionError(f"job {job_id} did not finish in {timeout} s (last state {state!r})\n{logs}")


def test_submitted_job_evaluates_once_after_training(slurm_cluster, inputs, tmp_path: Path) -> None:
    overrides, tasks = inputs
    run_dir = tmp_path / "run"
    res = dtlaunch(
        slurm_cluster.env, tmp_path, "submit", *overrides, "training.eval_tasks=[tiny_mc]", f"run.dir={run_dir}"
    )
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    job_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    state = wait_finished(slurm_cluster, job_id, run_dir)
    out = (run_dir / f"logs/slurm-{job_id}.out").read_text()
    err = (run_dir / f"logs/slurm-{job_id}.err").read_text()
    assert state == "COMPLETED" and slurm_cluster.job_field(job_id, "ExitCode") == "0:0", out[-2000:] + err[-3000:]
    # Once, by the batch shell, after the workers: one results file, of the final step's checkpoint.
    (path,) = (run_dir / "eval").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["step"] == STEPS and saved["request"]["tasks"] == ["tiny_mc"]
    assert out.count("eval results:") == 1 and str(path) in out, out[-2000:]
    # The scores `dtlaunch eval RUN` gives on the same run, here outside Slurm.
    local = tmp_path / "local"
    ref = dtlaunch(
        slurm_cluster.env,
        tmp_path,
        "eval",
        str(run_dir),
        "--tasks",
        "tiny_mc",
        "--include",
        str(tasks),
        "--out",
        str(local),
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    (ref_path,) = local.glob("*.json")
    expected = json.loads(ref_path.read_text())
    assert expected["step"] == STEPS
    assert saved["results"]["tiny_mc"]["acc,none"] == expected["results"]["tiny_mc"]["acc,none"]
    assert 0 < saved["n_samples"]["tiny_mc"]["effective"] == expected["n_samples"]["tiny_mc"]["effective"]


def test_bad_task_name_is_refused_before_submitting(slurm_cluster, inputs, tmp_path: Path) -> None:
    overrides, _ = inputs
    run_dir = tmp_path / "bad"
    res = dtlaunch(
        slurm_cluster.env, tmp_path, "submit", *overrides, "training.eval_tasks=[tiny_mcc]", f"run.dir={run_dir}"
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.eval_tasks: unknown task 'tiny_mcc'" in lines[0] and "tiny_mc" in lines[0]
    assert not run_dir.exists()
    assert not slurm_cluster.run("squeue", "-h").stdout.strip()
