"""RUN/state.json: what the launcher of a local run is doing (running, finished, failed, preempted,
interrupted), its pid and host, so that `dtlaunch status` can tell a live run from a dead one."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dtlaunch.run.run_dir import STATE_NAME


def record_state(run_dir: Path, state: str, **extra: Any) -> None:
    """Write the launcher's state, keeping what an earlier call recorded (pid, start time)."""
    path = Path(run_dir) / STATE_NAME
    data = read_state(run_dir) if state != "running" else {}
    if state == "running":
        data.update(pid=os.getpid(), host=socket.gethostname(), started=time.time())
    data.update(state=state, updated=time.time(), **extra)
    # A name of this writer's own: the launchers of a multi-node run share the run directory, and a
    # shared temporary name lets one rename away the file another is about to rename.
    tmp = path.with_name(f".{STATE_NAME}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def read_state(run_dir: Path) -> dict:
    try:
        return dict(json.loads((Path(run_dir) / STATE_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
