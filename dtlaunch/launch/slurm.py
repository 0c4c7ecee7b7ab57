"""Slurm: render an sbatch script into the run directory, submit it, and read the job's state back.

The script runs one `torchrun` per node (`srun --ntasks-per-node=1`), all meeting at a c10d rendezvous
on the first node of the allocation. Preemption: Slurm sends SIGUSR1 to the batch shell
`cluster.signal_before_s` seconds before the time limit (`--signal=B:USR1@N`); the shell forwards it to
the srun step (workers checkpoint at the next step boundary and exit with EXIT_PREEMPTED) and then
requeues the job, which resumes from that checkpoint. A step that exits with EXIT_PREEMPTED is requeued too.
With training.eval_tasks the final checkpoint is evaluated by a second job (slurm_eval.py), submitted
together with this one and started only after it succeeded, under its own time limit (cluster.eval_time):
this job's cluster.time is training's alone. Every configured value is shell-quoted; the only text written
as-is is `cluster.setup`, which is shell code by definition.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dtlaunch.config.layout import nproc_per_node
from dtlaunch.errors import EXIT_PREEMPTED, ConfigError, DtlaunchError, InputError
from dtlaunch.run.env import RUN_DIR_ENV, WORKER_MODULE

SCRIPT_NAME = "slurm.sbatch"
EVAL_MODULE = "dtlaunch.launch.eval_job"
RECORD_NAME = "slurm.json"
# Rendezvous ports are derived from the job id so that two jobs sharing a node do not collide.
PORT_BASE, PORT_SPAN = 20000, 20000


def _q(key: str, value: Any) -> str:
    """Shell-quote one configured value. A newline would end an `#SBATCH` comment line and turn the
    rest into a command, so it is refused rather than quoted."""
    text = str(value)
    if any(c in text for c in "\n\r\x00"):
        raise ConfigError(f"{key}={text!r} contains a line break or NUL: use a single-line value")
    return shlex.quote(text)


def _gpus_per_node(cfg: Any) -> int:
    """GPUs requested per node: only when the target hardware has GPUs (a CPU profile asks for none)."""
    if cfg.hardware.name == "cpu" or cfg.hardware.gpus_per_node <= 0:
        return 0
    return max(0, int(cfg.cluster.gpus_per_node))


def workers_per_node(cfg: Any) -> int:
    return nproc_per_node(cfg, _gpus_per_node(cfg) or None)


def check_log_dir(run_dir: Path) -> Path:
    if "%" in str(run_dir):
        # sbatch expands %j, %x, ... in --output/--error: a literal % would scramble the log path.
        raise ConfigError(f"run directory '{run_dir}' contains '%', which Slurm expands in log names: rename it")
    return Path(run_dir)


def user_sbatch_args(cfg: Any) -> list[str]:
    """cluster.sbatch_args, quoted: the site's extra options, for the training and the evaluation job."""
    opts = []
    for i, arg in enumerate(cfg.cluster.sbatch_args):
        if not str(arg).startswith("-"):
            raise ConfigError(f"cluster.sbatch_args[{i}]={arg!r} is not an option: write it as --name=value")
        opts.append(_q(f"cluster.sbatch_args[{i}]", arg))
    return opts


def sbatch_options(cfg: Any, run_dir: Path, job_name: str) -> list[str]:
    """The `#SBATCH` options, already quoted."""
    cl = cfg.cluster
    opts = [
        f"--job-name={_q('run.name', job_name)}",
        f"--nodes={int(cl.nodes)}",
        "--ntasks-per-node=1",
    ]
    gpus = _gpus_per_node(cfg)
    if gpus:
        opts.append(f"--gpus-per-node={gpus}")
    opts += site_options(cfg, run_dir, "time")
    opts.append(f"--signal=B:USR1@{int(cl.signal_before_s)}")
    return opts + user_sbatch_args(cfg)


def site_options(cfg: Any, run_dir: Path, time_key: str) -> list[str]:
    """The options a run's training and evaluation jobs share, quoted: CPUs per task, the site's memory,
    partition, account and qos, the time limit `cluster.<time_key>`, the logs, and requeue."""
    cl = cfg.cluster
    logs = check_log_dir(run_dir) / "logs"
    opts = [f"--cpus-per-task={int(cl.cpus_per_task)}"] if cl.cpus_per_task > 0 else []
    for option, key in (
        ("mem", "mem"),
        ("partition", "partition"),
        ("account", "account"),
        ("qos", "qos"),
        ("time", time_key),
    ):
        value = getattr(cl, key)
        if value:
            opts.append(f"--{option}={_q(f'cluster.{key}', value)}")
    return opts + [
        f"--output={_q('run.dir', logs / 'slurm-%j.out')}",
        f"--error={_q('run.dir', logs / 'slurm-%j.err')}",
        # Append: a requeued job keeps the log of its previous attempts.
        "--open-mode=append",
        "--requeue",
    ]


def _check_cluster(cfg: Any) -> None:
    cl = cfg.cluster
    if cl.nodes < 1:
        raise ConfigError(f"cluster.nodes={cl.nodes} must be >= 1")
    if cl.signal_before_s < 0:
        raise ConfigError(f"cluster.signal_before_s={cl.signal_before_s} must be >= 0")
    if cl.cpus_per_task < 0:
        raise ConfigError(f"cluster.cpus_per_task={cl.cpus_per_task} must be >= 0 (0 = Slurm's default)")


def render_script(cfg: Any, run_dir: Path, job_name: str = "", python: str = "") -> str:
    """The complete sbatch script for this job (bash)."""
    _check_cluster(cfg)
    run_dir = Path(run_dir)
    job_name = job_name or run_dir.name
    python = python or sys.executable
    la = cfg.launch
    nproc = workers_per_node(cfg)
    threads = int(la.threads_per_worker)
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in sbatch_options(cfg, run_dir, job_name)]
    lines += [
        f"# Written by `dtlaunch submit` for the run in {_q('run.dir', run_dir)}; resubmitting it resumes the run.",
        "set -u",
        f"export {RUN_DIR_ENV}={_q('run.dir', run_dir)}",
    ]
    if threads > 0:
        lines.append(f"export OMP_NUM_THREADS={threads}")
    else:
        # One share of the node's CPUs per worker, never 0.
        lines.append(
            f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} > 0 ? "
            f"${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} : 1 ))"
        )
    from dtlaunch.run.flight_recorder import launch_env

    # torch's collective flight recorder (launch.flight_recorder_entries): dumped on a collective timeout.
    lines += [f"export {k}={_q('run.dir', v)}" for k, v in launch_env(int(la.flight_recorder_entries), run_dir).items()]
    if cfg.cluster.setup:
        lines.append("# cluster.setup (shell code, run as written)")
        lines += [str(s) for s in cfg.cluster.setup]
    if la.rdzv_endpoint:
        endpoint = _q("launch.rdzv_endpoint", la.rdzv_endpoint)
    else:
        lines += [
            "# Rendezvous on the first node of the allocation; the port depends on the job and its attempt.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"rdzv_port=$(( {PORT_BASE} + (SLURM_JOB_ID * 7 + ${{SLURM_RESTART_COUNT:-0}}) % {PORT_SPAN} ))",
        ]
        endpoint = '"$head_node:$rdzv_port"'
    rdzv_id = _q("launch.rdzv_id", la.rdzv_id) if la.rdzv_id else '"$SLURM_JOB_ID"'
    # One option per line: the script is read by people debugging a job.
    torchrun = [
        f"{_q('python', python)} -m torch.distributed.run",
        '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--max-restarts={int(la.max_restarts)}",
        # torchrun must survive USR1 and hand it to its workers (by default USR1 would kill it).
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        # After forwarding a signal torchrun kills the workers after this long (default 30 s): give them
        # the time Slurm leaves before the limit, so they reach a step boundary and save.
        f"--shutdown-timeout={max(30, int(cfg.cluster.signal_before_s))}",
        f"--log-dir={_q('run.dir', run_dir / 'logs' / 'torchrun')}",
        f"-m {WORKER_MODULE}",
    ]
    lines += [
        "requeue=0",
        "srun_pid=",
        "# USR1 = the time limit is near (or `scancel --signal=USR1 --batch`): srun forwards USR1 to every",
        "# process of the step (never TERM: srun answers TERM by killing the step); workers checkpoint at the",
        "# next step boundary and exit, then the job requeues itself.",
        "on_usr1() {",
        '  echo "dtlaunch: SIGUSR1: workers checkpoint at the next step, then the job is requeued" >&2',
        "  requeue=1",
        '  if [ -n "$srun_pid" ]; then kill -USR1 "$srun_pid" 2>/dev/null; fi',
        "}",
        "# TERM = scancel, requeue or preemption: Slurm signals every step process itself; just keep waiting.",
        'on_term() { echo "dtlaunch: SIGTERM: workers checkpoint at the next step and stop" >&2; }',
        "trap on_usr1 USR1",
        "trap on_term TERM",
        'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\',
        "  " + " \\\n    ".join(torchrun) + " &",
        "srun_pid=$!",
        "# A trapped signal interrupts `wait`; keep waiting until the step has really ended.",
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done',
        'wait "$srun_pid"',
        "rc=$?",
        f'if [ "$rc" -eq {EXIT_PREEMPTED} ] || {{ [ "$requeue" -eq 1 ] && [ "$rc" -ne 0 ]; }}; then',
        '  echo "dtlaunch: stopped at a checkpoint (exit $rc): requeueing job $SLURM_JOB_ID" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        f"  exit {EXIT_PREEMPTED}",
        "fi",
        "# Exit 0 is what releases the evaluation job (training.eval_tasks: --dependency=afterok on this job).",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def write_script(cfg: Any, run_dir: Path, job_name: str = "") -> Path:
    """The training job's script, and with training.eval_tasks the evaluation job's beside it (a stale
    one from an earlier submission without them is removed: its presence means "submit it too")."""
    from dtlaunch.launch.slurm_eval import EVAL_SCRIPT_NAME, render_eval_script, wants_eval_job

    path = Path(run_dir) / SCRIPT_NAME
    path.write_text(render_script(cfg, run_dir, job_name))
    path.chmod(0o755)
    eval_path = Path(run_dir) / EVAL_SCRIPT_NAME
    if wants_eval_job(cfg):
        eval_path.write_text(render_eval_script(cfg, run_dir, job_name))
        eval_path.chmod(0o755)
    else:
        eval_path.unlink(missing_ok=True)
    return path


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
    from dtlaunch.launch.slurm_eval import render_eval_script, wants_eval_job

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
    from dtlaunch.launch.slurm_eval import EVAL_SCRIPT_NAME, dependency_option

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


ARRAY_SCRIPT_NAME = "slurm-array.sbatch"


def render_array_script(cfgs: Sequence[Any], run_dirs: Sequence[Path], sweep_dir: Path) -> str:
    """One job array for a sweep: task i runs the script `submit` writes into run_dirs[i] (same
    preemption and requeue handling as a single job). The allocation is shared by every task, so the
    points must agree on the resources they ask for."""
    sweep_dir = Path(sweep_dir)
    name = sweep_dir.name
    options = [sbatch_options(cfg, sweep_dir, name) for cfg in cfgs]
    for i, opts in enumerate(options[1:], start=1):
        if opts != options[0]:
            differ = next(b for a, b in zip(options[0], opts, strict=False) if a != b)
            raise ConfigError(
                f"sweep point {i} asks Slurm for other resources ({differ}) than point 0: a job array has one "
                f"allocation shape; submit the points separately"
            )
    from dtlaunch.launch.slurm_eval import render_eval_script, wants_eval_job

    for cfg, run_dir in zip(cfgs, run_dirs, strict=True):
        render_script(cfg, Path(run_dir))  # each task's own script must render (bad values fail here)
        if wants_eval_job(cfg):
            render_eval_script(cfg, Path(run_dir))  # and its evaluation job's
    # Slurm names an array task's log with %A (the array's id) and %a (the task index).
    opts = [o.replace("slurm-%j.", "slurm-%A_%a.") for o in options[0]]
    opts.insert(1, f"--array=0-{len(cfgs) - 1}")
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts)]
    lines += [
        f"# Written by `dtlaunch submit -m` for the sweep in {_q('run.dir', sweep_dir)}: task i runs point i.",
        "set -u",
        "run_dirs=(",
        *(f"  {_q('run.dir', d)}" for d in run_dirs),
        ")",
        'run_dir="${run_dirs[$SLURM_ARRAY_TASK_ID]}"',
        f'exec bash "$run_dir/{SCRIPT_NAME}"',
    ]
    return "\n".join(lines) + "\n"


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
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    script = sweep_dir / ARRAY_SCRIPT_NAME
    script.write_text(script_text)
    script.chmod(0o755)
    job_id = _sbatch(script)
    for i, run_dir in enumerate(run_dirs):
        task_id = f"{job_id}_{i}"
        _record(Path(run_dir), task_id, script, _submit_eval(Path(run_dir), task_id))
    return job_id
