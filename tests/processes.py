"""The training workers of a run, found in /proc: for tests that kill or watch them. A module of its own,
not conftest.py: `from conftest import ...` resolves to whichever conftest.py pytest imported first under
that name (tests/system/conftest.py when the layers are named on the command line)."""

from __future__ import annotations

from pathlib import Path


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s training worker of this run, from /proc (its environment names the run)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            b"dtlaunch.train.main" in cmd
            and f"RANK={rank}".encode() in env
            and f"DTLAUNCH_RUN_DIR={run_dir}".encode() in env
        ):
            return int(proc.name)
    return None


def run_workers(run_dir: Path) -> list[int]:
    """The pids of every live training worker of this run (any rank, any attempt), from /proc."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and b"dtlaunch.train.main" in cmd and f"DTLAUNCH_RUN_DIR={run_dir}".encode() in env:
            found.append(int(proc.name))
    return found
