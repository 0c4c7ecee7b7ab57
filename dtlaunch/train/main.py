"""Worker entry point: `python -m dtlaunch.train.main` under torchrun; reads $DTLAUNCH_RUN_DIR/config.yaml.

Order: signal handlers -> per-rank log file -> the resolved config the launcher wrote -> process group ->
the Trainer (dtlaunch.train.trainer) -> exit: 0 finished, 75 preempted with a checkpoint saved, 2 bad
input found only here (reported by the launcher as such), non-zero otherwise (torchrun's error file names
the rank).
"""

# ruff: noqa: E402 (the worker asks to die with its launcher before the slow imports)
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

# When this worker's Python began running dtlaunch (the rank's log is not open yet): its start-up phases.
STARTED = time.time()

from dtlaunch.run.known_noise import silence_known_noise
from dtlaunch.run.parent_death import die_with_launcher

if __name__ == "__main__":
    # First, before importing torch (seconds on a loaded machine): torchrun starts workers in sessions of
    # their own, so a launcher killed by SIGKILL would leave them training and pruning checkpoints.
    die_with_launcher()
    silence_known_noise()  # torchao's import-time lines, before the rank's log is even open

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dtlaunch.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, DtlaunchError
from dtlaunch.job.compose import load_resolved
from dtlaunch.run import preemption
from dtlaunch.run.env import RUN_DIR_ENV
from dtlaunch.run.phases import rank_log, startup_stamp
from dtlaunch.run.run_dir import CONFIG_NAME, RunDir
from dtlaunch.train.observe.profiling import oom_snapshot
from dtlaunch.train.parallel.process_group import init_distributed, restart_count, shutdown
from dtlaunch.train.trainer import Trainer

IMPORTED = time.time()


def redirect_logs(run_dir: Path, rank: int) -> None:
    """Per-rank log file logs/rank<R>.log: every rank's stderr, and stdout of ranks other than 0
    (rank 0's stdout stays on the user's terminal for the progress display)."""
    log_file = open(RunDir(run_dir).rank_log(rank), "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    log_file.write(f"--- rank {rank}, attempt {restart_count()}, pid {os.getpid()}, {time.strftime('%F %T')}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_file.fileno(), 2)
    if rank != 0:
        os.dup2(log_file.fileno(), 1)


@record
def main() -> None:
    preemption.install()  # first, so that an early SIGTERM/SIGUSR1 is not fatal
    run_dir = Path(os.environ[RUN_DIR_ENV])
    redirect_logs(run_dir, int(os.environ.get("RANK", "0")))
    # A crash inside torch's C++ (a segfault in a collective) kills the rank with no Python trace and
    # torchrun reports only the signal: dump every thread's stack into the rank's log first.
    faulthandler.enable(all_threads=True)
    # `dtlaunch debug RUN`: every thread's stack into this log on demand, while the run goes on.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    startup_stamp("worker started", STARTED)
    startup_stamp("worker imports done", IMPORTED)
    cfg = load_resolved(run_dir / CONFIG_NAME)
    env = init_distributed(cfg)
    startup_stamp("process group joined")
    try:
        Trainer(cfg, run_dir, env).fit()
    except preemption.PreemptionStop as stop:  # checkpoint saved; a new start resumes
        if env.rank == 0 and cfg.checkpoint.enabled:
            preemption.write_marker(run_dir, stop.step, stop.signum)
        rank_log(f"{stop}: checkpoint saved, exiting {EXIT_PREEMPTED}")
        shutdown(EXIT_PREEMPTED)
    except DtlaunchError as exc:
        if exc.exit_code != EXIT_BAD_INPUT:
            raise
        # The user's input, found wrong only here: the launcher reports it as such (exit 2).
        from dtlaunch.run.worker_errors import exit_with_input_error

        exit_with_input_error(run_dir, env.rank, str(exc))
    except torch.OutOfMemoryError as exc:
        snapshot = oom_snapshot(run_dir, env.rank)
        if snapshot is None:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        raise torch.OutOfMemoryError(f"memory snapshot {snapshot} (open at pytorch.org/memory_viz); {first}") from exc
    startup_stamp("training finished")
    # Only after success: on an error, peers may sit in a collective, and a barrier would hang this rank
    # instead of letting it exit so that torchrun stops the others.
    shutdown()


def exit_failed() -> NoReturn:
    """A worker that failed with an exception: print it as the interpreter would (into the rank's log, where
    the launcher points the user), run the exit handlers, and end with exit 1 without the interpreter's
    teardown of torch's modules: 1-2 s per worker on a loaded machine that a restart (launch.max_restarts)
    or the launcher's report waited for, since torchrun restarts or stops a job only once every rank has
    exited. A non-daemon thread still alive gets the ordinary exit, which waits for it."""
    import traceback

    from dtlaunch.run.fast_exit import exit_now, other_threads_alive

    if other_threads_alive():
        raise  # noqa: PLE0704 (called from an except block: the exception being handled)
    traceback.print_exc()
    exit_now(1)


if __name__ == "__main__":
    try:
        main()
    # Success, preemption and bad input end in os._exit already (shutdown, exit_with_input_error); an
    # explicit sys.exit and Ctrl-C keep the interpreter's own exit (their codes and its SIGINT status).
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        exit_failed()
