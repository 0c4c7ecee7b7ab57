"""`dtlaunch submit` / `status` against a real Slurm (started by the slurm_cluster fixture)."""

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
    pytest.mark.slow_reason("a real Slurm cluster: each job is queued, started and (requeue) interrupted for real"),
]

TINY = [
    "recipe=tiny_ddp",
    "cluster=slurm",
    "cluster.nodes=1",
    "cluster.time=00:10:00",
    "cluster.signal_before_s=30",
    "training.loss_plot=false",
]


def dtlaunch(env: dict, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_dtlaunch([*args], env=env, cwd=cwd, timeout=timeout)


def submit(cluster, tmp_path: Path, run_dir: Path, *overrides: str) -> str:
    res = dtlaunch(cluster.env, tmp_path, "submit", *TINY, f"run.dir={run_dir}", *overrides)
    assert res.returncode == 0, res.stderr + res.stdout
    m = re.search(r"submitted job (\d+)", res.stdout)
    assert m, res.stdout
    assert json.loads((run_dir / "slurm.json").read_text())["job_id"] == m.group(1)
    return m.group(1)


def status(cluster, run_dir: Path) -> dict:
    res = dtlaunch(cluster.env, run_dir.parent, "status", str(run_dir), "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def wait_finished(cluster, run_dir: Path, timeout: float = 150) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        st = status(cluster, run_dir)
        if st["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return st
        time.sleep(1)
    raise AssertionError(f"job did not finish in {timeout} s: {st}\n{job_output(run_dir)}")


def job_output(run_dir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*")) if p.is_file())


def logged_steps(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(int(r["step"]), float(r["loss"])) for r in recs]


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def release_requeued(cluster, job_id: str) -> None:
    """A requeued job waits ~120 s (Reason=BeginTime); start it now, but only once it is PENDING and its
    old steps are gone (earlier, slurmctld drains the node)."""
    cluster.wait_state(job_id, {"PENDING"}, timeout=90)
    cluster.wait_for(
        lambda: not cluster.run("squeue", "-h", "-s", "-j", job_id, check=False).stdout.strip(),
        60,
        f"the old steps of job {job_id} to end",
    )
    # slurmd revoked the old run's credential when its batch step ended, and it compares credential
    # times in whole seconds: a restart allocated within the same second is refused ("Job credential
    # revoked") and the job fails. Slurm's own requeue delay avoids that; releasing early must wait out
    # the second (seen: 2 failures in 5 runs without this).
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def test_submit_dry_run_prints_the_script(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "dry run"
    res = dtlaunch(
        slurm_cluster.env, tmp_path, "submit", *TINY, f"run.dir={run_dir}", "cluster.partition=debug", "--dry-run"
    )
    assert res.returncode == 0, res.stderr
    script = res.stdout
    assert script.startswith("#!/bin/bash\n")
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=debug",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@30",
        "#SBATCH --time=00:10:00",
    ):
        assert line in script.splitlines()
    assert "--gpus-per-node" not in script  # the cpu hardware profile asks for no GPUs
    assert "--nproc-per-node=2" in script and "--rdzv-backend=c10d" in script
    assert f"--output='{run_dir}/logs/slurm-%j.out'" in script
    assert not run_dir.exists() and not (tmp_path / "runs").exists()  # a dry run creates nothing
    # sbatch itself accepts the script (--test-only validates it against the live controller, submits nothing).
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = slurm_cluster.run("sbatch", "--test-only", str(path), check=False)
    assert check.returncode == 0, check.stderr
    assert not slurm_cluster.run("squeue", "-h", "-n", "dry run").stdout.strip()


def test_submit_trains_to_completion(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, tmp_path, run_dir, "training.steps=6", "checkpoint.every_steps=3")
    st = wait_finished(slurm_cluster, run_dir)
    assert st["state"] == "COMPLETED" and st["exit_code"] == "0:0", f"{st}\n{job_output(run_dir)}"
    assert st["job_id"] == job_id
    steps = [s for s, _ in logged_steps(run_dir)]
    assert steps == [1, 2, 3, 4, 5, 6], job_output(run_dir)
    assert (run_dir / "slurm.sbatch").is_file()
    assert (run_dir / f"logs/slurm-{job_id}.out").is_file()
    human = dtlaunch(slurm_cluster.env, tmp_path, "status", str(run_dir))
    assert human.returncode == 0 and f"job {job_id}: COMPLETED" in human.stdout


def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path: Path) -> None:
    """Two interruptions of one job: the time-limit signal (USR1 to the batch shell, which requeues
    the job itself) and an external `scontrol requeue`. Each attempt must resume from the newest
    checkpoint, and steps run twice must give the same loss."""
    run_dir = tmp_path / "requeue"
    # Each interruption follows a checkpoint seen on disk, so the first two attempts end by about step 8;
    # the steps after that only have to finish the job (every one of them re-checks resumed losses).
    steps = 14
    # Slow checkpoint saves (1 s each, every 2 steps) keep the job running long enough to interrupt.
    job_id = submit(
        slurm_cluster,
        tmp_path,
        run_dir,
        f"training.steps={steps}",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=20",
        "debug.slow_save_s=1.0",
    )
    cluster = slurm_cluster

    cluster.wait_for(lambda: newest_checkpoint(run_dir) >= 2, 120, "the first checkpoint")
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    release_requeued(cluster, job_id)
    assert cluster.job_field(job_id, "Restarts") == "1"
    first = newest_checkpoint(run_dir)

    cluster.wait_for(lambda: newest_checkpoint(run_dir) > first, 120, "a checkpoint from the second attempt")
    cluster.run("scontrol", "requeue", job_id)
    release_requeued(cluster, job_id)

    st = wait_finished(cluster, run_dir, timeout=180)
    assert st["state"] == "COMPLETED", f"{st}\n{job_output(run_dir)}"
    assert st["restarts"] == 2
    logged = logged_steps(run_dir)
    # Split the log into attempts where the step goes back; every later attempt starts after step 1.
    attempts: list[list[int]] = [[]]
    for s, _ in logged:
        if attempts[-1] and s <= attempts[-1][-1]:
            attempts.append([])
        attempts[-1].append(s)
    assert logged[-1][0] == steps, job_output(run_dir)
    assert attempts[0][0] == 1 and all(a[0] > 1 for a in attempts[1:]), attempts
    # Resumed, not restarted: step 1 ran exactly once; repeated steps reproduce the same loss.
    by_step: dict[int, set[float]] = {}
    for s, loss in logged:
        by_step.setdefault(s, set()).add(loss)
    assert sum(1 for s, _ in logged if s == 1) == 1
    assert all(len(v) == 1 for v in by_step.values()), {s: v for s, v in by_step.items() if len(v) > 1}
    assert set(by_step) == set(range(1, steps + 1))
