"""The training workers of a run, found in /proc: for tests that kill or watch them. A module of its own,
not conftest.py: `from conftest import ...` resolves to whichever conftest.py pytest imported first under
that name (tests/system/conftest.py when the layers are named on the command line)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def _workers(run_dir: Path) -> Iterator[tuple[int, list[bytes], str]]:
    """(pid, environment, state) of every process of this run's training workers (its environment names the
    run); processes that vanish while being read are skipped."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if b"dtlaunch.train.main" in cmd and f"DTLAUNCH_RUN_DIR={run_dir}".encode() in env:
            yield int(proc.name), env, state


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s training worker of this run."""
    return next((pid for pid, env, _ in _workers(run_dir) if f"RANK={rank}".encode() in env), None)


def run_workers(run_dir: Path) -> list[int]:
    """The pids of every live training worker of this run (any rank, any attempt)."""
    return [pid for pid, _, state in _workers(run_dir) if state != "Z"]
