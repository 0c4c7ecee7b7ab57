"""Slurm: render an sbatch script into the run directory, submit it, and read the job's state back.

The scripts' text (training, evaluation, a sweep's job array) is slurm_script.py's. With
training.eval_tasks the final checkpoint is evaluated by a second job, submitted together with the training
job and started only after it succeeded, under its own time limit (cluster.eval_time).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dtlaunch.errors import DtlaunchError, InputError
from dtlaunch.launch.slurm_script import (
    ARRAY_SCRIPT_NAME,
    EVAL_SCRIPT_NAME,
    dependency_option,
    render_eval_script,
    render_script,
    wants_eval_job,
    write_script,
)
from dtlaunch.run.run_dir import LOGS_DIR

RECORD_NAME = "slurm.json"


def _run(cmd: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
    tool = cmd[0]
    if shutil.which(tool) is None:
        raise DtlaunchError(f"`{tool}` not found on PATH: run this on a Slurm login node (or install slurm-client)")
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise DtlaunchError(f"`{' '.join(cmd)}` did not answer in {timeout:.0f} s: is slurmctld up?") from exc


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "no message"


@dataclass
class Submission:
    job_id: str  # the training job ("" for a dry run)
    eval_job_id: str = ""  # the evaluation job (training.eval_tasks), "" when there is none


def submit(job: Any, run_dir: Path, dry_run: bool = False) -> Submission:
    """Write the scripts into the run directory and `sbatch --parsable` them: the training job, then
    with training.eval_tasks the evaluation job, held until the training job succeeded. A dry run
    renders both and writes and submits nothing."""
    cfg = job.cfg if hasattr(job, "cfg") else job
    run_dir = Path(run_dir)
    if dry_run:
        render_script(cfg, run_dir, cfg.run.name or run_dir.name)
        if wants_eval_job(cfg):
            render_eval_script(cfg, run_dir, cfg.run.name or run_dir.name)
        return Submission("")
    script = write_script(cfg, run_dir, cfg.run.name or run_dir.name)
    job_id = _sbatch(script)
    eval_job_id = _submit_eval(run_dir, job_id)
    _record(run_dir, job_id, script, eval_job_id)
    return Submission(job_id, eval_job_id)


def _submit_eval(run_dir: Path, train_job_id: str) -> str:
    """The evaluation job of run_dir (its script there, written by write_script) after train_job_id; ""
    when the run has none. If sbatch refuses it, the training job is cancelled: a run submitted with
    training.eval_tasks never trains without its evaluation queued behind it."""
    script = run_dir / EVAL_SCRIPT_NAME
    if not script.is_file():
        return ""
    try:
        return _sbatch(script, dependency_option(train_job_id))
    except DtlaunchError as exc:
        base = train_job_id.split("_")[0]  # an array task: the whole array goes (its tasks share one fate)
        try:
            cancelled = _run(["scancel", base]).returncode == 0
        except DtlaunchError:
            cancelled = False
        done = f"training job {base} cancelled" if cancelled else f"cancel training job {base}: scancel {base}"
        raise DtlaunchError(f"{exc} (the evaluation job, {script}); {done}") from exc


def _record(run_dir: Path, job_id: str, script: Path, eval_job_id: str = "") -> None:
    path = run_dir / RECORD_NAME
    data = read_record(run_dir) if path.is_file() else {"jobs": []}
    entry = {"job_id": job_id, "script": str(script), "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if eval_job_id:
        entry["eval_job_id"] = eval_job_id
    data["jobs"].append(entry)
    data["job_id"] = job_id
    # The newest submission's evaluation only: an earlier one belongs to an earlier training job.
    data["eval_job_id"] = eval_job_id
    tmp = run_dir / f".{RECORD_NAME}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def read_record(run_dir: Path) -> dict:
    path = Path(run_dir) / RECORD_NAME
    if not path.is_file():
        raise InputError(f"'{run_dir}' has no {RECORD_NAME}: it was not submitted with `dtlaunch submit`")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc


@dataclass
class JobStatus:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ..., or UNKNOWN
    reason: str = ""
    exit_code: str = ""
    restarts: int = 0
    nodes: str = ""
    elapsed: str = ""
    source: str = ""  # which command answered

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    def as_dict(self) -> dict:
        return asdict(self)


FINISHED_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _from_scontrol(job_id: str) -> JobStatus | None:
    res = _run(["scontrol", "show", "job", "-o", job_id])
    if res.returncode != 0 or "JobState=" not in res.stdout:
        return None
    fields: dict[str, str] = {}
    for token in res.stdout.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return JobStatus(
        job_id=job_id,
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        exit_code=fields.get("ExitCode", ""),
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=fields.get("NodeList", ""),
        elapsed=fields.get("RunTime", ""),
        source="scontrol",
    )


def _from_sacct(job_id: str) -> JobStatus | None:
    # Needs accounting (slurmdbd); without it sacct exits 1 and we report what we know.
    if shutil.which("sacct") is None:
        return None
    res = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList,Elapsed"])
    rows = [r for r in res.stdout.splitlines() if r.strip()]
    if res.returncode != 0 or not rows:
        return None
    state, exit_code, nodes, elapsed = (rows[-1].split("|") + ["", "", "", ""])[:4]
    # sacct writes "CANCELLED by 0": keep the state word.
    return JobStatus(
        job_id=job_id, state=state.split()[0], exit_code=exit_code, nodes=nodes, elapsed=elapsed, source="sacct"
    )


def query_status(
    job_id: str, retries: int = 3, delay_s: float = 1.0, sleep: Callable[[float], None] = time.sleep
) -> JobStatus:
    """The job's state from scontrol (live and recently ended jobs), else sacct (accounting). Reads
    right after a submission or an ending can miss the job for a few seconds, so misses are retried."""
    for attempt in range(retries):
        for source in (_from_scontrol, _from_sacct):
            st = source(job_id)
            if st is not None:
                return st
        if attempt + 1 < retries:
            sleep(delay_s)
    return JobStatus(job_id=job_id, state="UNKNOWN", reason="no longer known to slurmctld (and no accounting)")


def status(run_dir: Path, retries: int = 3) -> JobStatus:
    """The state of the newest job submitted for this run directory."""
    return query_status(str(read_record(run_dir)["job_id"]), retries=retries)


def eval_status(run_dir: Path, retries: int = 3) -> JobStatus | None:
    """The state of the newest submission's evaluation job (training.eval_tasks); None without one."""
    eval_job_id = str(read_record(run_dir).get("eval_job_id") or "")
    return query_status(eval_job_id, retries=retries) if eval_job_id else None


def _sbatch(script: Path, *options: str) -> str:
    """Submit a script (options before it override its `#SBATCH` lines); the job id (`--parsable`
    prints "<id>" or "<id>;<cluster>")."""
    res = _run(["sbatch", "--parsable", *options, str(script)])
    if res.returncode != 0:
        raise DtlaunchError(f"sbatch failed (exit {res.returncode}): {_first_line(res.stderr or res.stdout)}")
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise DtlaunchError(f"sbatch printed no job id: {_first_line(res.stdout + res.stderr)}")
    return job_id


def submit_array(script_text: str, sweep_dir: Path, run_dirs: Sequence[Path]) -> str:
    """Write and `sbatch` the array script; record task i's job id (`<array id>_<i>`) in run_dirs[i], with
    the evaluation job of a point with training.eval_tasks (held until task i succeeded)."""
    sweep_dir = Path(sweep_dir)
    (sweep_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    script = sweep_dir / ARRAY_SCRIPT_NAME
    script.write_text(script_text)
    script.chmod(0o755)
    job_id = _sbatch(script)
    for i, run_dir in enumerate(run_dirs):
        task_id = f"{job_id}_{i}"
        _record(Path(run_dir), task_id, script, _submit_eval(Path(run_dir), task_id))
    return job_id
