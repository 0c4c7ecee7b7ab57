"""A run's live training workers, found in /proc (Linux): for `dtlaunch debug` and for tests that kill or
watch them.

A worker is known by its standard error, which it points at RUN/logs/rank<R>.log first thing
(dtlaunch.train.main) and keeps there for life: true of a worker exec'd as `python -m dtlaunch.train.main`
and of one forked from the launcher (dtlaunch.launch.forked_workers), whose command line and initial
environment are the launcher's. Processes a worker starts (the GRPO tool runner, data workers) inherit that
descriptor; they are told apart as the ones whose parent is a worker too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dtlaunch.run.run_dir import LOGS_DIR

_RANK_LOG = re.compile(r"rank(\d+)\.log$")


def _parent(pid: str) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])


def run_workers(run_dir: Path) -> dict[int, int]:
    """pid -> rank of every training worker process of `run_dir` (any attempt) alive now (a zombie has
    closed its descriptors)."""
    logs = str(Path(run_dir).resolve() / LOGS_DIR) + os.sep
    found: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            target = os.readlink(entry / "fd" / "2")
            if not target.startswith(logs):
                continue
            parent = _parent(entry.name)
        except (OSError, ValueError, IndexError):  # gone while read, or not ours to read
            continue
        match = _RANK_LOG.search(target)
        if match:
            found[int(entry.name)] = (int(match.group(1)), parent)
    return {pid: rank for pid, (rank, parent) in found.items() if parent not in found}


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s live worker of `run_dir`, if there is one."""
    return next((pid for pid, r in run_workers(run_dir).items() if r == rank), None)
