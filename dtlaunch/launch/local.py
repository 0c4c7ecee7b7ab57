"""Start the workers on this node with torchrun, in-process (`torch.distributed.run`).

One node without a rendezvous endpoint is `--standalone` (torchrun picks a free port). Per-rank logs are
written by the workers themselves into `run_dir/logs/rank<R>.log` (rank 0 keeps its stdout on the terminal
so the progress display works); torchrun's own files (error replies) go to `run_dir/logs/torchrun/`.
A failed worker becomes one `WorkerFailed` line naming the rank and its error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlaunch.config.layout import nproc_per_node
from dtlaunch.errors import EXIT_PREEMPTED, InputError, Preempted, WorkerFailed
from dtlaunch.run.env import RUN_DIR_ENV, WORKER_MODULE

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig, LaunchConfig


def _detected_gpus(cfg: JobConfig) -> int:
    """GPUs on this host; only asked (importing torch) when launch.nproc_per_node leaves it open."""
    if cfg.launch.nproc_per_node > 0:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_args(cfg: JobConfig, run_dir: Path, detected_gpus: int | None = None) -> list[str]:
    """The torchrun argument list (without the leading `torchrun`)."""
    la = cfg.launch
    nproc = nproc_per_node(cfg, detected_gpus)
    args = [f"--nnodes={la.nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={la.max_restarts}"]
    if la.nnodes == 1 and not la.rdzv_endpoint:
        args.append("--standalone")
    else:
        args += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={la.rdzv_endpoint}",
            f"--rdzv-id={la.rdzv_id or run_dir.name}",
        ]
        node_rank = node_rank_of(la)
        if node_rank >= 0:
            # The first node hosts the rendezvous store, said explicitly: torch's guess (endpoint == this
            # host's name or address) misses e.g. the address of a second interface or network namespace.
            args += [f"--node-rank={node_rank}", f"--rdzv-conf=is_host={str(node_rank == 0).lower()}"]
    # SIGUSR1 too (a scheduler's "time is nearly up"): torchrun passes it on, the workers checkpoint and exit 75.
    args.append("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    args += [f"--log-dir={run_dir / 'logs' / 'torchrun'}", "-m", WORKER_MODULE]
    return args


def node_rank_of(la: LaunchConfig) -> int:
    """launch.node_rank, else the scheduler's node index (SLURM_NODEID) or $NODE_RANK; -1 if unknown."""
    if la.node_rank >= 0:
        return int(la.node_rank)
    for var in ("SLURM_NODEID", "NODE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return -1


def follows_node_0(la: LaunchConfig) -> bool:
    """A node after the first of a multi-node job: node 0's launcher writes the shared run directory's config,
    plan and state (each node's own config differs from it in launch.node_rank, so theirs would displace it)."""
    return int(la.nnodes) > 1 and node_rank_of(la) > 0


def worker_env(cfg: JobConfig, run_dir: Path, detected_gpus: int | None = None) -> dict[str, str]:
    """Variables the workers inherit: the run directory and a thread count that does not oversubscribe."""
    threads = int(cfg.launch.threads_per_worker)
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // nproc_per_node(cfg, detected_gpus))
    from dtlaunch.run.flight_recorder import launch_env

    recorder = launch_env(int(cfg.launch.flight_recorder_entries), run_dir)
    return {RUN_DIR_ENV: str(run_dir), "OMP_NUM_THREADS": str(threads), **recorder}


def launch_command(cfg: JobConfig, run_dir: Path, detected_gpus: int | None = None) -> str:
    """The exact shell command equivalent to what `launch_local` runs (printed by --dry-run)."""
    if detected_gpus is None:
        detected_gpus = _detected_gpus(cfg)
    env = worker_env(cfg, run_dir, detected_gpus)
    # Every argument is quoted whole, `--opt=value` parts included: a value holding `$(...)`, a quote or
    # a newline must reach torchrun as one literal argument when the line is pasted into a shell.
    assignments = [f"{k}={shell_word(v)}" for k, v in env.items()]
    return " ".join(assignments + [shell_word(w) for w in ["torchrun", *torchrun_args(cfg, run_dir, detected_gpus)]])


# Control characters as bash's $'...' writes them; others as \xHH.
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def shell_word(word: str) -> str:
    """shlex.quote, kept on one line: a word with a control character (a newline in run.name) is written
    $'...' (bash, zsh, ksh), since a quoted newline splits the printed command over lines that a user
    copies one at a time, or a terminal runs one at a time."""
    if not any(ord(c) < 32 or ord(c) == 127 for c in word):
        return shlex.quote(word)
    body = "".join(_ANSI_C.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in word)
    return f"$'{body}'"


def _cheap_rendezvous_event_names() -> None:
    """torch's rendezvous names each event it records by calling inspect.stack() twice, which builds every
    frame's source context and searches sys.modules: ~50 ms a call with torch imported, 18 calls, about
    0.9 s of every launch. The same name read off the frame chain costs microseconds."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if not callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        return

    def get_method_name(depth: int = 2) -> str:
        # inspect.stack()[depth] counted from torch's function; sys._getframe(depth) from this one: the same frame.
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def launch_local(cfg: JobConfig, run_dir: Path) -> None:
    """Run the workers to completion; raise WorkerFailed (exit 1) naming the first rank that failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from dtlaunch.launch.forked_workers import forked_workers
    from dtlaunch.run import flight_recorder, preemption, worker_errors

    _cheap_rendezvous_event_names()
    gpus = _detected_gpus(cfg)
    args = get_args_parser().parse_args(torchrun_args(cfg, run_dir, gpus))
    # SIGTERM/SIGUSR1 are ours (preemption.forward_signals), not the agent's.
    args.signals_to_handle = preemption.agent_signals()
    preemption.clear_marker(run_dir)
    worker_errors.clear(run_dir)
    flight_recorder.clear(run_dir)
    launched_at = time.time()
    os.environ.update(worker_env(cfg, run_dir, gpus))
    # torchrun's agent logs every failure and SIGTERM it sends as several warning lines; the user gets
    # our single line instead (the details stay in logs/rank<R>.log).
    # Child loggers with their own level (the agent's "Received 15 death signal") need silencing too.
    names = ["torch.distributed.elastic"] + [
        n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic.")
    ]
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    start = forked_workers(levels) if use_forks(cfg) else contextlib.nullcontext()
    try:
        with preemption.forward_signals(grace_s=float(cfg.launch.timeout_s)), start:
            run(args)
    except ChildFailedError as exc:
        if all(f.exitcode == EXIT_PREEMPTED for f in exc.failures.values()):
            raise Preempted(preempted_message(run_dir, "a signal", cfg)) from None
        message = worker_errors.read(run_dir)
        if message is not None:  # a worker found bad input: the user's error (exit 2), not a crash
            raise InputError(message) from None
        raise WorkerFailed(describe_failure(exc, run_dir)) from None
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        if preemption.read_marker(run_dir) is None and finished_since(run_dir, launched_at, int(cfg.training.steps)):
            return  # the signal came after the last step's checkpoint and summary: the run is complete
        raise Preempted(preempted_message(run_dir, exc.sigval.name, cfg)) from None
    finally:
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)


def use_forks(cfg: JobConfig) -> bool:
    """launch.worker_start=auto, and this launcher preloaded the workers' imports where a fork is safe
    (dtlaunch.launch.forked_workers)."""
    from dtlaunch.launch.forked_workers import ready

    return str(cfg.launch.worker_start) == "auto" and ready()


def finished_since(run_dir: Path, launched_at: float, total_steps: int) -> bool:
    """Whether this launch's workers completed the run: rank 0 writes summary.json after the final
    checkpoint, so a fresh one (not an earlier launch's) that reached the last step means done."""
    import json

    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < launched_at:
            return False
        return int(json.loads(path.read_text()).get("final_step") or 0) >= total_steps
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def preempted_message(run_dir: Path, signame: str, cfg: JobConfig | None = None) -> str:
    """The one line for a stopped run: where it was saved (exit 75), or that nothing was (exit 1)."""
    from dtlaunch.run import preemption

    marker = preemption.read_marker(run_dir)
    if marker is None:
        older = _newest_checkpoint(cfg, run_dir) if cfg is not None else None
        if older is not None:  # not saved at the stop, but a new start still resumes from an earlier one
            return (
                f"stopped by {signame} before the workers saved at a step boundary; the newest checkpoint is "
                f"{older.path.name}: run the same command again to resume from it"
            )
        raise WorkerFailed(
            f"stopped by {signame} before a checkpoint was saved (the workers did not reach a step boundary in "
            f"launch.timeout_s, or checkpoint.enabled=false): see {run_dir / 'logs'}"
        )
    return (
        f"preempted by {marker['signal']}: checkpoint saved at step {marker['step']}; "
        f"run the same command again to resume"
    )


def _newest_checkpoint(cfg: JobConfig, run_dir: Path) -> Any:
    from dtlaunch.run.checkpoints import checkpoint_root, newest_complete

    return newest_complete(checkpoint_root(cfg, run_dir))[0] if cfg.checkpoint.enabled else None


# Errors a rank reports because a *peer* died (its collective lost the connection) or because the agent
# stopped it: never the root cause when another rank has a real error.
_COLLATERAL = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "signal ", "timed out")


def describe_failure(exc: Any, run_dir: Path) -> str:
    """One line: the rank that failed first with its own error (from the file `record` wrote) and its log.

    Error-file timestamps have one-second resolution, so a peer's "connection closed" often ties with the
    real failure; failures that look collateral are ranked after the others.
    """

    def text(failure: Any) -> str:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        message = str(message or "").strip()
        if not message or message.startswith("To enable traceback"):
            return f"exited with code {failure.exitcode}"
        # `record` stores "ExcType: message", the last line of the traceback; a multi-line message keeps
        # its first line here and the rest stays in the log.
        return message.splitlines()[0]

    def rank_key(item: tuple[int, Any]) -> tuple:
        rank, failure = item
        collateral = any(word in text(failure).lower() for word in _COLLATERAL) or failure.exitcode < 0
        return (collateral, failure.timestamp, rank)

    rank, failure = min(exc.failures.items(), key=rank_key)
    return f"rank {rank} failed: {text(failure)} (log: {run_dir / 'logs' / f'rank{rank}.log'})"
