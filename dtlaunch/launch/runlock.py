"""One launcher per run directory: `RUN/launcher.lock`, held with flock for the job's life.

Two launchers on one run directory would train the same steps twice and prune each other's checkpoints
(keep_last). The lock is the kernel's (fcntl.flock): it goes with the last descriptor of the process that
holds it, whatever killed that process, so a stale lock never blocks a restart. The file names the holder
(pid and host) for the refusal's message; its content means nothing once the lock is free.

A multi-node run on a shared filesystem has one owner, node 0; the other nodes' launchers join node 0's
rendezvous, which already refuses a second job under the same rendezvous id.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from dtlaunch.errors import InputError

LOCK_NAME = "launcher.lock"


def lock_run_dir(run_dir: Path) -> int:
    """Take the run directory's lock (creating the directory); returns its descriptor, which the caller
    keeps open for as long as the job runs. InputError (exit 2) naming the holder when it is taken."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise InputError(f"cannot create run directory '{run_dir}': {exc.strerror}; set run.dir or run.root") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise InputError(
            f"run directory '{run_dir}' is in use by another `dtlaunch train` ({holder}): wait until it ends or "
            "stop it, or set run.name / run.dir to another directory"
        ) from None
    record_holder(fd)
    return fd


def record_holder(fd: int) -> None:
    """Name this process as the holder: again by the launcher that received the lock from the warm
    start's child (dtlaunch.launch.warm_start), which took it."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)


def _holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(data['pid'])} on host {data['host']}"
    except (OSError, ValueError, TypeError, KeyError):  # the holder has not written its name yet
        return "pid unknown"
