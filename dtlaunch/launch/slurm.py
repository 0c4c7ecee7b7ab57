"""Slurm: render an sbatch script into the run directory, submit it, and read the job's state back.

The script runs one `torchrun` per node (`srun --ntasks-per-node=1`), all meeting at a c10d rendezvous
on the first node of the allocation. Preemption: Slurm sends SIGUSR1 to the batch shell
`cluster.signal_before_s` seconds before the time limit (`--signal=B:USR1@N`); the shell forwards it to
the srun step (workers checkpoint at the next step boundary and exit with EXIT_PREEMPTED) and then
requeues the job, which resumes from that checkpoint. A step that exits with EXIT_PREEMPTED is requeued too.
With training.eval_tasks the batch shell evaluates the final checkpoint after a step that ended with 0
(dtlaunch.launch.eval_job), as `dtlaunch train` does in its launcher. Every configured value is shell-quoted; the only
text written as-is is `cluster.setup`, which is shell code by definition.
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


def sbatch_options(cfg: Any, run_dir: Path, job_name: str) -> list[str]:
    """The `#SBATCH` options, already quoted."""
    cl = cfg.cluster
    logs = run_dir / "logs"
    if "%" in str(run_dir):
        # sbatch expands %j, %x, ... in --output/--error: a literal % would scramble the log path.
        raise ConfigError(f"run directory '{run_dir}' contains '%', which Slurm expands in log names: rename it")
    opts = [
        f"--job-name={_q('run.name', job_name)}",
        f"--nodes={int(cl.nodes)}",
        "--ntasks-per-node=1",
    ]
    gpus = _gpus_per_node(cfg)
    if gpus:
        opts.append(f"--gpus-per-node={gpus}")
    if cl.cpus_per_task > 0:
        opts.append(f"--cpus-per-task={int(cl.cpus_per_task)}")
    for key in ("mem", "partition", "account", "qos", "time"):
        value = getattr(cl, key)
        if value:
            opts.append(f"--{key}={_q(f'cluster.{key}', value)}")
    opts += [
        f"--output={_q('run.dir', logs / 'slurm-%j.out')}",
        f"--error={_q('run.dir', logs / 'slurm-%j.err')}",
        # Append: a requeued job keeps the log of its previous attempts.
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{int(cl.signal_before_s)}",
    ]
    for i, arg in enumerate(cl.sbatch_args):
        if not str(arg).startswith("-"):
            raise ConfigError(f"cluster.sbatch_args[{i}]={arg!r} is not an option: write it as --name=value")
        opts.append(_q(f"cluster.sbatch_args[{i}]", arg))
    return opts


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
    ]
    lines += _eval_lines(cfg, run_dir, python)
    lines.append('exit "$rc"')
    return "\n".join(lines) + "\n"


def _eval_lines(cfg: Any, run_dir: Path, python: str) -> list[str]:
    """training.eval_tasks: once, in this batch shell (the job's launcher, on the allocation's first node),
    after the step has ended with 0, i.e. every worker on every node has exited; as `dtlaunch train` does
    in its launcher. The workers are gone, so the evaluation gets all of the node's CPUs."""
    if not cfg.training.eval_tasks:
        return []
    return [
        "# training.eval_tasks: the final checkpoint evaluated once, now that every worker has exited.",
        'if [ "$rc" -eq 0 ]; then',
        '  OMP_NUM_THREADS="${SLURM_CPUS_ON_NODE:-1}" '
        f"{_q('python', python)} -m {EVAL_MODULE} {_q('run.dir', run_dir)}",
        "  rc=$?",
        "fi",
    ]


def write_script(cfg: Any, run_dir: Path, job_name: str = "") -> Path:
    path = Path(run_dir) / SCRIPT_NAME
    path.write_text(render_script(cfg, run_dir, job_name))
    path.chmod(0o755)
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


def submit(job: Any, run_dir: Path, dry_run: bool = False) -> str:
    """Write the script into the run directory and `sbatch --parsable` it; return the job id
    ("" for a dry run, which writes and submits nothing)."""
    cfg = job.cfg if hasattr(job, "cfg") else job
    run_dir = Path(run_dir)
    if dry_run:
        render_script(cfg, run_dir, cfg.run.name or run_dir.name)
        return ""
    script = write_script(cfg, run_dir, cfg.run.name or run_dir.name)
    job_id = _sbatch(script)
    _record(run_dir, job_id, script)
    return job_id


def _record(run_dir: Path, job_id: str, script: Path) -> None:
    path = run_dir / RECORD_NAME
    data = read_record(run_dir) if path.is_file() else {"jobs": []}
    data["jobs"].append({"job_id": job_id, "script": str(script), "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    data["job_id"] = job_id
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
    for cfg, run_dir in zip(cfgs, run_dirs, strict=True):
        render_script(cfg, Path(run_dir))  # each task's own script must render (bad values fail here)
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


def _sbatch(script: Path) -> str:
    """Submit a script; the job id (`--parsable` prints "<id>" or "<id>;<cluster>")."""
    res = _run(["sbatch", "--parsable", str(script)])
    if res.returncode != 0:
        raise DtlaunchError(f"sbatch failed (exit {res.returncode}): {_first_line(res.stderr or res.stdout)}")
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise DtlaunchError(f"sbatch printed no job id: {_first_line(res.stdout + res.stderr)}")
    return job_id


def submit_array(script_text: str, sweep_dir: Path, run_dirs: Sequence[Path]) -> str:
    """Write and `sbatch` the array script; record task i's job id (`<array id>_<i>`) in run_dirs[i]."""
    sweep_dir = Path(sweep_dir)
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    script = sweep_dir / ARRAY_SCRIPT_NAME
    script.write_text(script_text)
    script.chmod(0o755)
    job_id = _sbatch(script)
    for i, run_dir in enumerate(run_dirs):
        _record(Path(run_dir), f"{job_id}_{i}", script)
    return job_id
