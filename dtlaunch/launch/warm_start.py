"""Overlap the launcher's two slow starts: preparing the job and importing torch's agent.

Before the first worker starts, `dtlaunch train` composes, validates and plans the job, creates the
run directory and checks its data (about half a second of pure Python for a small job), then imports
torch's elastic agent (about 1.3 s on a CPU machine). Neither needs the other until the launch, so
where a second core is free the preparation runs in a forked child while this process imports the
agent; the child hands over what the launch needs through a pipe.

What the user sees does not change: the child prints what the preparation prints, errors included
(one line and the documented exit code, which this process then exits with at once: the child's exit
interrupts the import), and the process that receives signals and supervises the workers is this one, as
without the overlap. Environment variables the preparation sets for the workers travel with the
handover.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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
    cfg: Any = None
    env: dict[str, Optional[str]] = field(default_factory=dict)  # set (or removed: None) by the preparation


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
    prepare: Callable[[], Prepared], report: Callable[[BaseException], int]
) -> tuple[Optional[Prepared], int]:
    """Run `prepare` in a forked child while this process imports torch's agent. Returns (what it
    prepared, 0), or (None, exit code) when the child failed (it has printed why, via `report`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: prepare, hand over, and never return into the caller's stack
        os.close(read_fd)
        code = 0
        try:
            before = dict(os.environ)
            prepared = prepare()
            prepared.env = _changes(before, dict(os.environ))
            prepared.cfg = _container(prepared.cfg)
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(pickle.dumps(prepared))
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
    os.close(write_fd)
    try:
        _import_agent_unless_child_fails(pid)
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
        code = _exit_code(_wait(pid))
    except _ChildFailed as failed:
        os.close(read_fd)
        _finished.pop(pid, None)
        return None, failed.code
    except KeyboardInterrupt:  # the child got the same Ctrl-C and says so
        return None, _exit_code(_wait(pid)) or 130
    if code != 0 or not data:
        return None, code or 1
    prepared = pickle.loads(data)
    for key, value in prepared.env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return prepared, 0


class _ChildFailed(BaseException):  # not an Exception: no `except Exception` inside an import swallows it
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _import_agent_unless_child_fails(pid: int) -> None:
    """Import torch's agent; a child that exits with an error meanwhile interrupts the import (its
    SIGCHLD raises here), so a mistake in the job is reported as fast as without the overlap."""

    def on_child_exit(signum: int, frame: Any) -> None:
        if pid in _finished:
            return
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:  # reaped here: its status is kept for the caller's wait
            _finished[pid] = status
            if _exit_code(status) != 0:
                raise _ChildFailed(_exit_code(status))

    _finished.pop(pid, None)
    previous = signal.signal(signal.SIGCHLD, on_child_exit)
    try:
        on_child_exit(signal.SIGCHLD, None)  # it may have exited before the handler was in place
        try:
            importlib.import_module("torch.distributed.run")
        except Exception:  # the launch imports it again and reports a broken torch there, with context
            pass
    finally:
        signal.signal(signal.SIGCHLD, previous)
    if pid in _finished and _exit_code(_finished[pid]) != 0:
        raise _ChildFailed(_exit_code(_finished.pop(pid)))


# Exit statuses the SIGCHLD handler collected (a second waitpid on a reaped child would fail).
_finished: dict[int, int] = {}


def _wait(pid: int) -> int:
    status = _finished.pop(pid, None)
    return status if status is not None else os.waitpid(pid, 0)[1]


def _container(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else cfg


def _changes(before: dict[str, str], after: dict[str, str]) -> dict[str, Optional[str]]:
    changed: dict[str, Optional[str]] = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: None for k in before if k not in after})
    return changed


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return _SIGNAL_BASE - code if code < 0 else code
