"""The training workers of a run, for tests that kill or watch them: dtlaunch.run.worker_processes (each
worker's standard error is its run's logs/rank<R>.log, whether it was exec'd or forked from the launcher).
A module of its own, not conftest.py: `from conftest import ...` resolves to whichever conftest.py pytest
imported first under that name (tests/system/conftest.py when the layers are named on the command line)."""

from __future__ import annotations

from pathlib import Path

from dtlaunch.run import worker_processes


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s training worker of this run."""
    return worker_processes.worker_pid(run_dir, rank)


def run_workers(run_dir: Path) -> list[int]:
    """The pids of every live training worker of this run (any rank, any attempt)."""
    return sorted(worker_processes.run_workers(run_dir))
