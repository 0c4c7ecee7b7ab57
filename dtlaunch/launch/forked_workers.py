"""Workers started as forks of the launcher instead of fresh Pythons: the launcher has imported what a
worker imports (torch, torch.distributed.tensor, dynamo, the trainer), so a worker starts training at once.

torchrun's agent still starts, watches, signals, restarts and stops every worker: only the way one process
per rank comes to exist changes. The agent asks for `python -u -m dtlaunch.train.main` with an environment;
`ForkedWorker` gives it a process that behaves as that one would (a session of its own, exactly that
environment, unbuffered standard streams, a fresh interpreter's signal dispositions, no exit handlers of
the launcher's, torch's thread count from OMP_NUM_THREADS) and runs the worker's `main` in it. The exec
start costs each worker 2-7 s of imports (bench/launch_time.py), paid by every `dtlaunch train` and every
restart; a fork costs milliseconds.

A fork is only taken where it is safe (`fork_possible`): Linux, no CUDA device visible (CUDA does not
survive a fork of a process that touched the driver, and GPU workers are few per node), standard streams
that are the process's own descriptors, and a launcher that has done nothing but import: its preparation
ran in a forked child (dtlaunch.launch.warm_start), which is when `preload` runs. A process that has run
one parallel CPU kernel holds an OpenMP thread pool that its forks inherit half of: a fork running on more
than one thread deadlocks in its first parallel kernel. Elsewhere, or with `launch.worker_start=exec`, the
agent runs the command as torchrun does.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn, Optional

from dtlaunch.run.env import WORKER_MODULE

# What a worker imports before its first step that the launcher does not import on its own: the worker's
# module tree, and dynamo, which torch.optim imports at the optimizer's first add_param_group.
PRELOAD = (WORKER_MODULE, "torch._dynamo")


_preloaded = False


def preload() -> None:
    """Import what the workers will need, so that their forks find it imported. Called by a launcher that
    has computed nothing (its preparation runs aside, dtlaunch.launch.warm_start): the one kind of process
    whose workers may be forks of it (`ready`)."""
    global _preloaded
    for name in PRELOAD:
        importlib.import_module(name)
    _preloaded = True


def ready() -> bool:
    """Whether this launcher preloaded the workers' imports, having computed nothing before."""
    return _preloaded


def fork_possible() -> bool:
    """Whether the workers of this launcher can be its forks (see the module's docstring)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    try:
        if sys.stdout.fileno() != 1 or sys.stderr.fileno() != 2:
            return False
    except (AttributeError, OSError, ValueError):  # in-process callers that capture the streams in memory
        return False
    import torch

    # False on a CPU build without asking the driver; on a machine with GPUs the answer initialises the
    # driver in this process, after which no fork of it may use CUDA: the workers are then exec'd.
    return not torch.cuda.is_available()


class ForkedWorker:
    """The part of subprocess.Popen that torchrun's agent uses (pid, poll, wait, send_signal), for a child
    forked from this process that runs the worker's main and never returns into the caller's stack."""

    def __init__(self, env: dict[str, str], restore_log_levels: dict[str, int]) -> None:
        self.returncode: Optional[int] = None
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()  # else the child would write the launcher's buffered text a second time
        pid = os.fork()
        if pid == 0:
            _run_worker(env, restore_log_levels)
        self.pid = pid
        self.args = [sys.executable, "-u", "-m", WORKER_MODULE]

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, its status unknown
                self.returncode = 1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return int(self.returncode or 0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fresh_signal_dispositions() -> None:
    """The dispositions a new Python starts with (the launcher's handlers forward signals to workers,
    and torchrun's raise its SignalException: neither belongs in a worker)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            current = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(current) or current is signal.SIG_IGN:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Python's own choice at start-up
    with contextlib.suppress(AttributeError, ValueError, OSError):
        signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _unbuffered_streams() -> None:
    """`python -u`: the worker's prints reach the terminal (rank 0's progress) as they are written."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = "backslashreplace" if name == "stderr" else (getattr(old, "errors", None) or "strict")
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True))
        setattr(sys, f"__{name}__", getattr(sys, name))


def _run_worker(env: dict[str, str], restore_log_levels: dict[str, int]) -> NoReturn:
    """The child: become what `python -u -m dtlaunch.train.main` would be, run its main, exit."""
    code = 1
    try:
        os.setsid()  # torchrun's start_new_session: the agent stops a worker with os.killpg
        _fresh_signal_dispositions()
        atexit._clear()  # the launcher's exit handlers (its temporary files, its trackers) are not ours
        os.environ.clear()
        os.environ.update(env)
        _unbuffered_streams()
        import logging

        for name, level in restore_log_levels.items():
            logging.getLogger(name).setLevel(level)
        worker = sys.modules[WORKER_MODULE]
        sys.argv = [str(getattr(worker, "__file__", WORKER_MODULE))]
        worker.STARTED = worker.IMPORTED = time.time()
        import torch

        # OMP_NUM_THREADS was read when the launcher loaded torch, before the agent set it for workers.
        # Only a different count is set: torch.set_num_threads also pins MKL to that many threads for
        # every GEMM (a fresh process lets MKL choose per GEMM), which made a forked 2-thread worker's
        # step 3-4 % slower than with the same count left as the launcher had it (bench/throughput_sliced.py).
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
        code = _run_main(worker)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # nothing may return into the launcher's stack: report as the worker would
        import traceback

        with contextlib.suppress(BaseException):
            traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _run_main(worker: Any) -> int:
    """What `if __name__ == "__main__"` of dtlaunch.train.main does, as a status."""
    from dtlaunch.run.known_noise import silence_known_noise
    from dtlaunch.run.parent_death import die_with_launcher

    die_with_launcher()
    silence_known_noise()
    try:
        worker.main()
    except SystemExit as exc:  # sys.exit in the worker: the exit handlers run, as in the interpreter's exit
        atexit._run_exitfuncs()
        return _exit_status(exc.code)
    except KeyboardInterrupt:  # the interpreter's status for it: killed by SIGINT
        atexit._run_exitfuncs()
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        worker.exit_failed()  # prints the traceback into the rank's log and exits 1
    atexit._run_exitfuncs()
    return 0


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def forked_workers(restore_log_levels: dict[str, int]) -> Iterator[None]:
    """While the agent runs: its `python -u -m dtlaunch.train.main` workers are forks of this process
    (any other command it is given still runs as a subprocess)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    original = api.get_subprocess_handler

    class ForkingHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if tuple(args[1:]) == ("-u", "-m", WORKER_MODULE) and self._stdout is None and self._stderr is None:
                return ForkedWorker(env, restore_log_levels)
            return super()._popen(args, env)

    def get_handler(**kwargs: Any) -> SubprocessHandler:
        return ForkingHandler(**kwargs)

    api.get_subprocess_handler = get_handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original
