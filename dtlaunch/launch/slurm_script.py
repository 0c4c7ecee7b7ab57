"""The sbatch scripts of a run, as text: the training job's, the evaluation job's and a sweep's job array.

Training: one `torchrun` per node (`srun --ntasks-per-node=1`), all meeting at a c10d rendezvous on the
first node of the allocation. Preemption: Slurm sends SIGUSR1 to the batch shell `cluster.signal_before_s`
seconds before the time limit (`--signal=B:USR1@N`); the shell forwards it to the srun step (workers
checkpoint at the next step boundary and exit with EXIT_PREEMPTED) and then requeues the job, which resumes
from that checkpoint. A step that exits with EXIT_PREEMPTED is requeued too. Every configured value is
shell-quoted; the only text written as-is is `cluster.setup`, which is shell code by definition.

Evaluation (training.eval_tasks): the final checkpoint is evaluated by a job of its own. `dtlaunch submit`
sends it right after the training job with `sbatch --dependency=afterok:<training job>`, so it starts only
once training has ended with exit 0, and runs under its own time limit (cluster.eval_time): training keeps
all of cluster.time, and a training job that uses its whole limit cannot leave the evaluation to be killed
by it.

Requeue: a requeued training job (its own `scontrol requeue` after the time-limit signal, preemption with
PreemptMode=REQUEUE, or an external `scontrol requeue`) goes back to PENDING under the same job id
without ever reaching a final state, so the dependency stays unresolved (Reason=Dependency) until an
attempt really ends. COMPLETED (exit 0) releases the evaluation; any other end (FAILED, CANCELLED,
TIMEOUT, a requeue that could not be done: exit 75) can never satisfy it, and `--kill-on-invalid-dep=yes`
cancels the evaluation job then instead of leaving it pending forever. The evaluation is one node, one
task: the checkpoint holds the full model, and `dtlaunch eval` loads it on one device (one GPU when the
hardware profile has GPUs, else the CPUs).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dtlaunch.config.layout import nproc_per_node
from dtlaunch.errors import EXIT_PREEMPTED, ConfigError
from dtlaunch.run.env import RUN_DIR_ENV, WORKER_MODULE
from dtlaunch.run.flight_recorder import launch_env
from dtlaunch.run.run_dir import LOGS_DIR

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

SCRIPT_NAME = "slurm.sbatch"
EVAL_SCRIPT_NAME = "slurm-eval.sbatch"
ARRAY_SCRIPT_NAME = "slurm-array.sbatch"
EVAL_MODULE = "dtlaunch.commands.eval_job"
# Rendezvous ports are derived from the job id so that two jobs sharing a node do not collide.
PORT_BASE, PORT_SPAN = 20000, 20000


def quote(key: str, value: Any) -> str:
    """Shell-quote one configured value. A newline would end an `#SBATCH` comment line and turn the
    rest into a command, so it is refused rather than quoted."""
    text = str(value)
    if any(c in text for c in "\n\r\x00"):
        raise ConfigError(f"{key}={text!r} contains a line break or NUL: use a single-line value")
    return shlex.quote(text)


def gpus_per_node(cfg: JobConfig) -> int:
    """GPUs requested per node: only when the target hardware has GPUs (a CPU profile asks for none)."""
    if cfg.hardware.name == "cpu" or cfg.hardware.gpus_per_node <= 0:
        return 0
    return max(0, int(cfg.cluster.gpus_per_node))


def workers_per_node(cfg: JobConfig) -> int:
    return nproc_per_node(cfg, gpus_per_node(cfg) or None)


def check_log_dir(run_dir: Path) -> Path:
    if "%" in str(run_dir):
        # sbatch expands %j, %x, ... in --output/--error: a literal % would scramble the log path.
        raise ConfigError(f"run directory '{run_dir}' contains '%', which Slurm expands in log names: rename it")
    return Path(run_dir)


def user_sbatch_args(cfg: JobConfig) -> list[str]:
    """cluster.sbatch_args, quoted: the site's extra options, for the training and the evaluation job."""
    opts = []
    for i, arg in enumerate(cfg.cluster.sbatch_args):
        if not str(arg).startswith("-"):
            raise ConfigError(f"cluster.sbatch_args[{i}]={arg!r} is not an option: write it as --name=value")
        opts.append(quote(f"cluster.sbatch_args[{i}]", arg))
    return opts


def sbatch_options(cfg: JobConfig, run_dir: Path, job_name: str) -> list[str]:
    """The `#SBATCH` options, already quoted."""
    cl = cfg.cluster
    opts = [
        f"--job-name={quote('run.name', job_name)}",
        f"--nodes={int(cl.nodes)}",
        "--ntasks-per-node=1",
    ]
    gpus = gpus_per_node(cfg)
    if gpus:
        opts.append(f"--gpus-per-node={gpus}")
    opts += site_options(cfg, run_dir, "time")
    opts.append(f"--signal=B:USR1@{int(cl.signal_before_s)}")
    return opts + user_sbatch_args(cfg)


def site_options(cfg: JobConfig, run_dir: Path, time_key: str) -> list[str]:
    """The options a run's training and evaluation jobs share, quoted: CPUs per task, the site's memory,
    partition, account and qos, the time limit `cluster.<time_key>`, the logs, and requeue."""
    cl = cfg.cluster
    logs = check_log_dir(run_dir) / LOGS_DIR
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
            opts.append(f"--{option}={quote(f'cluster.{key}', value)}")
    return opts + [
        f"--output={quote('run.dir', logs / 'slurm-%j.out')}",
        f"--error={quote('run.dir', logs / 'slurm-%j.err')}",
        # Append: a requeued job keeps the log of its previous attempts.
        "--open-mode=append",
        "--requeue",
    ]


def check_cluster(cfg: JobConfig) -> None:
    cl = cfg.cluster
    if cl.nodes < 1:
        raise ConfigError(f"cluster.nodes={cl.nodes} must be >= 1")
    if cl.signal_before_s < 0:
        raise ConfigError(f"cluster.signal_before_s={cl.signal_before_s} must be >= 0")
    if cl.cpus_per_task < 0:
        raise ConfigError(f"cluster.cpus_per_task={cl.cpus_per_task} must be >= 0 (0 = Slurm's default)")


def render_script(cfg: JobConfig, run_dir: Path, job_name: str = "", python: str = "") -> str:
    """The complete sbatch script for this job (bash)."""
    check_cluster(cfg)
    run_dir = Path(run_dir)
    job_name = job_name or run_dir.name
    python = python or sys.executable
    la = cfg.launch
    nproc = workers_per_node(cfg)
    threads = int(la.threads_per_worker)
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in sbatch_options(cfg, run_dir, job_name)]
    lines += [
        f"# Written by `dtlaunch submit` for the run in {quote('run.dir', run_dir)}; resubmitting it resumes the run.",
        "set -u",
        f"export {RUN_DIR_ENV}={quote('run.dir', run_dir)}",
    ]
    if threads > 0:
        lines.append(f"export OMP_NUM_THREADS={threads}")
    else:
        # One share of the node's CPUs per worker, never 0.
        lines.append(
            f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} > 0 ? "
            f"${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} : 1 ))"
        )
    # torch's collective flight recorder (launch.flight_recorder_entries): dumped on a collective timeout.
    lines += [
        f"export {k}={quote('run.dir', v)}" for k, v in launch_env(int(la.flight_recorder_entries), run_dir).items()
    ]
    if cfg.cluster.setup:
        lines.append("# cluster.setup (shell code, run as written)")
        lines += [str(s) for s in cfg.cluster.setup]
    if la.rdzv_endpoint:
        endpoint = quote("launch.rdzv_endpoint", la.rdzv_endpoint)
    else:
        lines += [
            "# Rendezvous on the first node of the allocation; the port depends on the job and its attempt.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"rdzv_port=$(( {PORT_BASE} + (SLURM_JOB_ID * 7 + ${{SLURM_RESTART_COUNT:-0}}) % {PORT_SPAN} ))",
        ]
        endpoint = '"$head_node:$rdzv_port"'
    rdzv_id = quote("launch.rdzv_id", la.rdzv_id) if la.rdzv_id else '"$SLURM_JOB_ID"'
    # One option per line: the script is read by people debugging a job.
    torchrun = [
        f"{quote('python', python)} -m torch.distributed.run",
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
        f"--log-dir={quote('run.dir', run_dir / 'logs' / 'torchrun')}",
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


def write_script(cfg: JobConfig, run_dir: Path, job_name: str = "") -> Path:
    """The training job's script, and with training.eval_tasks the evaluation job's beside it (a stale
    one from an earlier submission without them is removed: its presence means "submit it too")."""
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


def wants_eval_job(cfg: JobConfig) -> bool:
    return bool(cfg.training.eval_tasks)


def dependency_option(train_job_id: str) -> str:
    """The `sbatch` option that holds the evaluation until this training job (or array task) succeeded."""
    return f"--dependency=afterok:{train_job_id}"


def eval_sbatch_options(cfg: JobConfig, run_dir: Path, job_name: str) -> list[str]:
    """The evaluation job's `#SBATCH` options, already quoted: the training job's site options
    (partition, account, qos, mem, sbatch_args) on one node with one task and one GPU, its own time
    limit (cluster.eval_time). Requeued when preempted or its node is lost: it evaluates again from the
    start (it writes its results only at the end)."""
    opts = [f"--job-name={quote('run.name', job_name + '-eval')}", "--nodes=1", "--ntasks=1"]
    if gpus_per_node(cfg):
        opts.append("--gpus-per-node=1")
    opts += site_options(cfg, run_dir, "eval_time")
    # Training ended in any other way than exit 0: cancel this job rather than leave it pending forever.
    opts.append("--kill-on-invalid-dep=yes")
    return opts + user_sbatch_args(cfg)


def render_eval_script(cfg: JobConfig, run_dir: Path, job_name: str = "", python: str = "") -> str:
    """The evaluation job's sbatch script (bash); submitted with dependency_option(<training job id>)."""
    run_dir = Path(run_dir)
    job_name = job_name or run_dir.name
    python = python or sys.executable
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in eval_sbatch_options(cfg, run_dir, job_name)]
    lines += [
        f"# Written by `dtlaunch submit` for the run in {quote('run.dir', run_dir)}: training.eval_tasks on its final",
        "# checkpoint. Submitted with `sbatch --dependency=afterok:<training job id>`: it starts only after the",
        "# training job has ended with exit 0.",
        "set -u",
        f"export {RUN_DIR_ENV}={quote('run.dir', run_dir)}",
    ]
    if cfg.cluster.setup:
        lines.append("# cluster.setup (shell code, run as written)")
        lines += [str(s) for s in cfg.cluster.setup]
    lines += [
        "# One process: it gets all of the job's CPUs.",
        f'OMP_NUM_THREADS="${{SLURM_CPUS_ON_NODE:-1}}" exec {quote("python", python)} -m {EVAL_MODULE} '
        f"{quote('run.dir', run_dir)}",
    ]
    return "\n".join(lines) + "\n"


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
        if wants_eval_job(cfg):
            render_eval_script(cfg, Path(run_dir))  # and its evaluation job's
    # Slurm names an array task's log with %A (the array's id) and %a (the task index).
    opts = [o.replace("slurm-%j.", "slurm-%A_%a.") for o in options[0]]
    opts.insert(1, f"--array=0-{len(cfgs) - 1}")
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts)]
    lines += [
        f"# Written by `dtlaunch submit -m` for the sweep in {quote('run.dir', sweep_dir)}: task i runs point i.",
        "set -u",
        "run_dirs=(",
        *(f"  {quote('run.dir', d)}" for d in run_dirs),
        ")",
        'run_dir="${run_dirs[$SLURM_ARRAY_TASK_ID]}"',
        f'exec bash "$run_dir/{SCRIPT_NAME}"',
    ]
    return "\n".join(lines) + "\n"
