"""`torchrun --standalone --nproc-per-node=N worker.py` for a test whose file is also the worker, with the ranks
forked from the pytest process instead of exec'd: torch and dtlaunch are imported already, where torchrun and
each exec'd rank spend 2-5 CPU-seconds importing them (tests/distributed/test_checkpoint.py alone launches 12
times).

A rank sees what torchrun gives it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
TORCHELASTIC_RESTART_COUNT, and MASTER_ADDR / MASTER_PORT of a store this process hosts, as the agent does
(TORCHELASTIC_USE_AGENT_STORE), over the caller's environment; and standard streams of its own. It runs on one torch thread: the pytest process may hold an OpenMP pool, and a
fork that uses it deadlocks in its first parallel kernel. The caller gets torchrun's status (0, or 1 when a
rank failed; its siblings are then killed, as torchrun's agent does, not left blocked in a collective) and
the ranks' output, rank 0's first.

Imported by the test modules of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NoReturn, Optional


def run_ranks(
    nproc: int, main: Callable[[], object], env: Optional[dict[str, str]] = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run `main()` on `nproc` forked ranks with torchrun's environment; the output is in `stdout`."""
    env = dict(os.environ if env is None else env)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = [tempfile.TemporaryFile() for _ in range(nproc)]
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # else each rank would write the caller's buffered text again
        pids = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _rank(rank, nproc, port, env, logs[rank].fileno(), main)
            pids.append(pid)
        # torchrun's agent hosts the job's store and every rank is its client (TORCHELASTIC_USE_AGENT_STORE).
        # Started after the forks (its server thread is not copied into them); the clients retry meanwhile.
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size=nproc, is_master=True, wait_for_workers=False)
        try:
            failed = _wait(pids, timeout)
        finally:
            del store
        out = ""
        for log in logs:
            log.seek(0)
            out += log.read().decode(errors="replace")
    finally:
        for log in logs:
            log.close()
    command = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", getattr(main, "__name__", "main")]
    if failed is None:
        raise subprocess.TimeoutExpired(command, timeout, output=out)
    return subprocess.CompletedProcess(command, 1 if failed else 0, out, "")


def _wait(pids: list[int], timeout: float) -> Optional[bool]:
    """Whether a rank failed (None: still running at `timeout`); the rest are killed once one fails."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        late = time.monotonic() > deadline
        if (failed or late) and len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return None if late and not failed else True
        time.sleep(0.01)
    return any(code != 0 for code in codes.values())


def _rank(rank: int, world: int, port: int, env: dict[str, str], log_fd: int, main: Callable[[], object]) -> NoReturn:
    """The forked child: become rank `rank` of a torchrun launch, run `main`, exit with its status."""
    code = 1
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
            )
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        atexit._clear()  # pytest's exit handlers are not the rank's
        logging.root.handlers.clear()  # pytest's capture handlers: a rank's warnings go to its own stderr
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        import faulthandler

        import torch

        faulthandler.enable(sys.stderr)  # a rank that dies in C++ leaves its Python stack in the output
        torch.set_num_threads(1)
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - nothing may return into pytest's stack
                pass
        os._exit(code & 0xFF)
