"""training.eval_tasks on jobs `dtlaunch submit` sent to a real Slurm (the slurm_cluster fixture): the
evaluation is a second job, held until the training job succeeded (--dependency=afterok), with its own time
limit (cluster.eval_time) while training keeps cluster.time. It evaluates the final checkpoint once into
RUN/eval/<time>.json, with the scores `dtlaunch eval RUN` gives on the same run; a requeued training job
keeps it waiting until the job really completed; a failed one cancels it; a bad task name is refused
(exit 2, one line) before anything is submitted. Offline: one multiple-choice task of our own over local JSONL."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from cli_server import run_dtlaunch

pytestmark = [
    pytest.mark.system,
    pytest.mark.slow,
    pytest.mark.slow_reason("real Slurm jobs: training, then an lm-eval job started by a dependency"),
]
pytest.importorskip("lm_eval")

STEPS = 3


def dtlaunch(env: dict, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return run_dtlaunch([*args], env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def inputs(tiny_eval_inputs) -> tuple[list[str], Path]:
    """The job's overrides and the task directory (tests/conftest.py: tiny_eval_inputs)."""
    overrides, tasks = tiny_eval_inputs
    job = ["recipe=tiny_ddp", "cluster=slurm", "cluster.nodes=1", "cluster.time=00:10:00"]
    return [*job, *overrides, f"training.steps={STEPS}", f"checkpoint.every_steps={STEPS}"], tasks


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("slurm-*")))


def wait_finished(cluster, job_id: str, run_dir: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = cluster.job_field(job_id, "JobState")
        if state in FINISHED:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s (last state {state!r})\n{job_logs(run_dir)}")


def submit(cluster, tmp_path: Path, run_dir: Path, overrides: list[str], *extra: str) -> tuple[str, str]:
    """The training and the evaluation job ids `submit` printed."""
    res = dtlaunch(
        cluster.env, tmp_path, "submit", *overrides, "training.eval_tasks=[tiny_mc]", f"run.dir={run_dir}", *extra
    )
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    train_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    eval_id = re.search(rf"submitted evaluation job (\d+) .*starts once job {train_id} has succeeded", res.stdout)
    assert eval_id, res.stdout
    return train_id, eval_id.group(1)


def log_text(run_dir: Path, job_id: str) -> str:
    return "".join((run_dir / f"logs/slurm-{job_id}.{ext}").read_text() for ext in ("out", "err"))


def test_evaluation_is_its_own_job_and_waits_out_a_requeue(slurm_cluster, inputs, tmp_path: Path) -> None:
    """The evaluation is its own job (own time limit, one task), started once after training ended, with
    the scores `dtlaunch eval RUN` gives. The training job is interrupted once on the way, by the time-limit
    signal: the workers checkpoint, the batch shell requeues its job (exit 75). The job is PENDING again
    under its id, never finished, so afterok still waits; the evaluation runs once, after the requeued
    attempt completed, on the final step. (One job carries both claims: each training and evaluation job
    costs a submission, a training and an lm-eval start.)"""
    overrides, tasks = inputs
    run_dir = tmp_path / "run"
    cluster = slurm_cluster
    train_id, eval_id = submit(
        cluster,
        tmp_path,
        run_dir,
        overrides,
        "cluster.eval_time=00:07:00",
        "debug.hold_at_step=2",
        "debug.fail_rank=1",
        "cluster.signal_before_s=30",
    )
    # Each job its own limit: training keeps all of cluster.time; one node, one task for the evaluation.
    assert cluster.job_field(train_id, "TimeLimit") == "00:10:00"
    assert cluster.job_field(eval_id, "TimeLimit") == "00:07:00"
    assert cluster.job_field(eval_id, "NumNodes") in ("1", "1-1") and cluster.job_field(eval_id, "NumTasks") == "1"
    assert cluster.job_field(eval_id, "Dependency") in (f"afterok:{train_id}(unfulfilled)", "(null)")

    rank_log = run_dir / "logs" / "rank1.log"
    cluster.wait_for(lambda: rank_log.is_file() and "holding at step 2" in rank_log.read_text(), 180, "rank 1 to hold")
    cluster.run("scancel", "--signal=USR1", "--batch", train_id)
    cluster.wait_state(train_id, {"PENDING"}, timeout=90)
    assert "requeueing job" in log_text(run_dir, train_id)
    # Requeued, not finished: the evaluation still waits on its dependency, and nothing was evaluated.
    assert cluster.job_field(eval_id, "JobState") == "PENDING"
    assert cluster.job_field(eval_id, "Reason") == "Dependency"
    assert not (run_dir / "eval").exists()
    # Release the requeued job now rather than after Slurm's ~2 min hold (see test_slurm.release_requeued).
    cluster.wait_for(
        lambda: not cluster.run("squeue", "-h", "-s", "-j", train_id, check=False).stdout.strip(), 60, "old steps"
    )
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={train_id}", "StartTime=now")

    state = wait_finished(cluster, train_id, run_dir)
    assert state == "COMPLETED" and cluster.job_field(train_id, "ExitCode") == "0:0", job_logs(run_dir)
    assert cluster.job_field(train_id, "Restarts") == "1"
    assert wait_finished(cluster, eval_id, run_dir) == "COMPLETED", job_logs(run_dir)
    assert cluster.job_field(eval_id, "ExitCode") == "0:0", job_logs(run_dir)
    # Never in the training job; once in the evaluation job, after training ended.
    assert "eval results:" not in log_text(run_dir, train_id) and "eval_job" not in log_text(run_dir, train_id)
    train_end = cluster.job_field(train_id, "EndTime")
    assert cluster.job_field(eval_id, "StartTime") >= train_end
    (path,) = (run_dir / "eval").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["step"] == STEPS and saved["request"]["tasks"] == ["tiny_mc"]
    out = (run_dir / f"logs/slurm-{eval_id}.out").read_text()
    assert out.count("eval results:") == 1 and str(path) in out, out[-2000:]
    # `status` follows both jobs.
    st = dtlaunch(cluster.env, tmp_path, "status", str(run_dir), "--json")
    assert st.returncode == 0, st.stderr
    record = json.loads(st.stdout)
    assert (record["job_id"], record["state"]) == (train_id, "COMPLETED")
    assert (record["eval_job"]["job_id"], record["eval_job"]["state"]) == (eval_id, "COMPLETED")
    human = dtlaunch(cluster.env, tmp_path, "status", str(run_dir)).stdout
    assert f"job {train_id}: COMPLETED" in human and f"evaluation job {eval_id}: COMPLETED" in human, human
    # The scores `dtlaunch eval RUN` gives on the same run, here outside Slurm.
    local = tmp_path / "local"
    ref = dtlaunch(
        cluster.env, tmp_path, "eval", str(run_dir), "--tasks", "tiny_mc", "--include", str(tasks), "--out", str(local)
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    (ref_path,) = local.glob("*.json")
    expected = json.loads(ref_path.read_text())
    assert expected["step"] == STEPS
    assert saved["results"]["tiny_mc"]["acc,none"] == expected["results"]["tiny_mc"]["acc,none"]
    assert 0 < saved["n_samples"]["tiny_mc"]["effective"] == expected["n_samples"]["tiny_mc"]["effective"]


def test_failed_training_cancels_the_evaluation(slurm_cluster, inputs, tmp_path: Path) -> None:
    overrides, _ = inputs
    run_dir = tmp_path / "failed"
    train_id, eval_id = submit(slurm_cluster, tmp_path, run_dir, overrides, "debug.fail_at_step=2")
    assert wait_finished(slurm_cluster, train_id, run_dir) == "FAILED", job_logs(run_dir)
    # --kill-on-invalid-dep=yes: cancelled, not left pending forever; it never ran.
    assert wait_finished(slurm_cluster, eval_id, run_dir, timeout=120) == "CANCELLED"
    assert slurm_cluster.job_field(eval_id, "Reason") == "DependencyNeverSatisfied"
    assert not (run_dir / "eval").exists() and not (run_dir / f"logs/slurm-{eval_id}.out").exists()


def test_sweep_points_evaluate_after_their_own_tasks(slurm_cluster, inputs, tmp_path: Path) -> None:
    """A job array: point i's evaluation job depends on array task <array id>_<i> alone."""
    overrides, _ = inputs
    sweep = tmp_path / "sweep"
    args = ["submit", "-m", *overrides, "training.eval_tasks=[tiny_mc]", "optim.lr=1e-3,1e-2", f"run.dir={sweep}"]
    res = dtlaunch(slurm_cluster.env, tmp_path, *args)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    array_id = re.search(r"submitted job array (\d+) \(2 tasks\)", res.stdout).group(1)
    found = re.search(rf"submitted evaluation jobs .*: {array_id}_0: (\d+), {array_id}_1: (\d+)", res.stdout)
    assert found, res.stdout
    for i, eval_id in enumerate(found.groups()):  # read at once: a fulfilled dependency reads "(null)"
        assert slurm_cluster.job_field(eval_id, "Dependency") == f"afterok:{array_id}_{i}(unfulfilled)"
    for i, eval_id in enumerate(found.groups()):
        run_dir = sweep / str(i)
        assert wait_finished(slurm_cluster, eval_id, run_dir) == "COMPLETED", job_logs(sweep)
        (path,) = (run_dir / "eval").glob("*.json")
        assert json.loads(path.read_text())["step"] == STEPS


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
