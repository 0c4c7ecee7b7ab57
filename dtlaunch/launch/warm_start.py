"""Overlap the launcher's two slow starts: preparing the job and importing torch's agent.

Before the first worker starts, `dtlaunch train` composes, validates and plans the job, creates the
run directory and checks its data (about half a second of pure Python for a small job), then imports
torch's elastic agent (about 1.3 s on a CPU machine). Neither needs the other until the launch, so
where a second core is free the preparation runs in a forked child while this process imports the
agent; the child hands over what the launch needs through a socket.

What the user sees does not change: the child prints what the preparation prints, errors included
(one line and the documented exit code, which this process then exits with at once: a thread that
waits for the child ends the process while the import still runs), and the process that receives
signals and supervises the workers is this one, as without the overlap. Environment variables the
preparation sets for the workers travel with the handover, and so does the run directory's lock.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from dtlaunch.run.parent_death import die_with_parent

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# The exit status of a child stopped by a signal, as a shell reports it.
_SIGNAL_BASE = 128


@dataclass
class Prepared:
    """What the launch needs from the preparation. Across the fork the config travels as its plain
    container: a typed config node does not pickle, and the run directory's copy is no substitute (on
    a shared filesystem every node of a multi-node job writes its own there)."""

    run_dir: str
    layout: Any
    recipe: str
    # The job from prepare(); its plain container across the fork (typed again by the launch).
    cfg: Optional[JobConfig | dict[str, Any]] = None
    env: dict[str, Optional[str]] = field(default_factory=dict)  # set (or removed: None) by the preparation
    # The run directory's lock (dtlaunch.launch.runlock), held for the job's life; -1: none taken.
    lock_fd: int = -1


def overlap_possible() -> bool:
    """A fork is safe and worth it: a POSIX system with a spare core, no other threads (a fork copies
    their locks, held or not), and standard streams that are the process's own descriptors (in-process
    callers that capture them in memory would lose what the child prints)."""
    if not hasattr(os, "fork") or (os.cpu_count() or 1) < 2 or threading.active_count() > 1:
        return False
    try:
        return sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def prepare_aside(
    prepare: Callable[[], Prepared], report: Callable[[BaseException], int], exit_at_once: bool = False
) -> tuple[Optional[Prepared], int]:
    """Run `prepare` in a forked child while this process imports torch's agent. Returns (what it
    prepared, 0), or (None, exit code) when the child failed (it has printed why, via `report`).

    `exit_at_once` (the CLI, with nothing of its own to clean up yet): a child that fails while the
    import runs ends this process at once with the child's exit code, instead of after the import."""
    sys.stdout.flush()
    sys.stderr.flush()
    # A socket rather than a pipe: besides the bytes, the run directory's lock crosses it (SCM_RIGHTS),
    # so that the lock the child took stays held by the same open file, never released in between.
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: prepare, hand over, and never return into the caller's stack
        parent_sock.close()
        code = 0
        try:
            # A launcher killed by SIGKILL takes its preparation along (which holds the run directory's lock).
            die_with_parent(launcher)
            before = dict(os.environ)
            prepared = prepare()
            prepared.env = _changes(before, dict(os.environ))
            prepared.cfg = _container(prepared.cfg)
            payload = pickle.dumps(prepared)
            fds = [prepared.lock_fd] if prepared.lock_fd >= 0 else []
            socket.send_fds(child_sock, [len(payload).to_bytes(8, "big")], fds)
            child_sock.sendall(payload)
            child_sock.close()
        except BaseException as exc:  # everything the CLI would report, reported the same way
            try:
                code = report(exc)
            except BaseException:  # --debug: the traceback, as the CLI would show it
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    child_sock.close()
    waiter = _ChildWaiter(pid, exit_at_once)
    try:
        waiter.start()
        try:
            importlib.import_module("torch.distributed.run")
            from dtlaunch.launch.forked_workers import fork_possible, preload

            if fork_possible():  # and what the workers import, if they are to be forks of this process
                preload()
        except Exception:  # the launch imports it again and reports a broken torch there, with context
            pass
        waiter.import_done()
        if waiter.failed():  # it failed during the import: no handover is coming
            return None, waiter.code()
        prepared, lock_fds = _receive(parent_sock)
    except KeyboardInterrupt:  # the child got the same Ctrl-C and says so
        return None, waiter.code() or 130
    finally:
        parent_sock.close()
    code = waiter.code()
    if code != 0 or prepared is None:
        for fd in lock_fds:
            os.close(fd)
        return None, code or 1
    prepared.lock_fd = lock_fds[0] if lock_fds else -1
    for key, value in prepared.env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return prepared, 0


class _ChildWaiter(threading.Thread):
    """Waits for the child in a thread, never in a signal handler: an exception raised by a handler lands
    wherever the import happens to be (inside a weakref callback of the import lock it is printed as
    "Exception ignored", inside torch's C++ it aborts the process with SIGABRT)."""

    def __init__(self, pid: int, exit_at_once: bool) -> None:
        super().__init__(name="dtlaunch-warm-start", daemon=True)
        self.pid = pid
        self.exit_at_once = exit_at_once
        self.status: Optional[int] = None
        self._importing = True
        self._lock = threading.Lock()

    def run(self) -> None:
        status = os.waitpid(self.pid, 0)[1]
        with self._lock:
            self.status = status
            if self.exit_at_once and self._importing and _exit_code(status) != 0:
                # The child printed the error line; this process has written nothing since the fork and
                # holds nothing to release: end it now, without unwinding the import in the main thread.
                os._exit(_exit_code(status))

    def import_done(self) -> None:
        with self._lock:
            self._importing = False

    def failed(self) -> bool:
        with self._lock:
            return self.status is not None and _exit_code(self.status) != 0

    def code(self) -> int:
        self.join()
        assert self.status is not None
        return _exit_code(self.status)


def _receive(sock: socket.socket) -> tuple[Optional[Prepared], list[int]]:
    """The child's handover: an 8-byte length with the lock's descriptor, then the pickled Prepared.
    (None, []) when the child exited without one."""
    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 1)
    for fd in fds:
        os.set_inheritable(fd, False)  # the lock stays with the launcher, never with its workers
    while head and len(head) < 8:
        more = sock.recv(8 - len(head))
        if not more:
            break
        head += more
    if len(head) < 8:
        return None, fds
    size = int.from_bytes(head, "big")
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(1 << 20, size - got))
        if not chunk:
            return None, fds
        chunks.append(chunk)
        got += len(chunk)
    return pickle.loads(b"".join(chunks)), fds


def _container(cfg: Optional[JobConfig]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else cfg


def _changes(before: dict[str, str], after: dict[str, str]) -> dict[str, Optional[str]]:
    changed: dict[str, Optional[str]] = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: None for k in before if k not in after})
    return changed


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return _SIGNAL_BASE - code if code < 0 else code
