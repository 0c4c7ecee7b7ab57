"""`debug RUN`: every rank's Python stacks of a live local run, on demand (a hung or slow run, looked into).

Each worker registers faulthandler on SIGUSR2 (dtlaunch.train.main), so the default way needs nothing
installed: the workers of the run (dtlaunch.run.worker_processes) get SIGUSR2, write all their threads'
stacks into logs/rank<R>.log, and the new part of each log is printed here.
`--py-spy` reads the stacks from outside instead (py-spy's `dump`, needs py-spy and ptrace permission),
which also works for a rank stuck inside C++ holding the interpreter lock, where a signal handler never runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import RunDir

STACK_SIGNAL = signal.SIGUSR2


def _live_workers(run_dir: Path) -> dict[int, int]:
    from dtlaunch.launch.runstate import pid_alive, read_state

    state = read_state(run_dir)
    pid, host = state.get("pid"), state.get("host")
    if state.get("state") != "running" or not isinstance(pid, int) or not pid_alive(pid):
        raise InputError(f"run '{run_dir}' is not running (dtlaunch status {run_dir}): stacks exist only in a live run")
    if host != socket.gethostname():
        raise InputError(f"run '{run_dir}' runs on {host}, not here: run `dtlaunch debug` on {host}")
    from dtlaunch.run.worker_processes import run_workers

    ranks = {rank: p for p, rank in sorted(run_workers(run_dir).items())}
    if not ranks:
        raise InputError(f"run '{run_dir}' has no training workers yet (starting or ending): try again in a moment")
    return ranks


def _signal_stacks(run_dir: Path, ranks: dict[int, int], wait_s: float) -> dict[int, str]:
    """SIGUSR2 to every worker; each rank's log text written since, once it stops growing."""
    logs = {r: RunDir(run_dir).rank_log(r) for r in ranks}
    sizes = {r: logs[r].stat().st_size if logs[r].is_file() else 0 for r in ranks}
    for pid in ranks.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {r: logs[r].stat().st_size if logs[r].is_file() else 0 for r in ranks}
        if now == last and all(now[r] > sizes[r] for r in ranks):
            break
        last = now
    out = {}
    for r in ranks:
        with logs[r].open("rb") as f:
            f.seek(sizes[r])
            out[r] = f.read().decode(errors="replace")
    return out


def _py_spy_stacks(ranks: dict[int, int]) -> dict[int, str]:
    tool = shutil.which("py-spy")
    if tool is None:
        raise InputError("--py-spy: py-spy is not installed: `pip install py-spy`, or leave out --py-spy")
    out = {}
    for rank, pid in ranks.items():
        proc = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        out[rank] = proc.stdout if proc.returncode == 0 else f"py-spy failed: {proc.stderr.strip()}\n"
    return out


def debug_command(run: str, root: Optional[str], py_spy: bool, wait_s: float = 5.0) -> int:
    from dtlaunch.commands.status import resolve_run_dir

    run_dir = resolve_run_dir(run, root)
    ranks = _live_workers(run_dir)
    stacks = _py_spy_stacks(ranks) if py_spy else _signal_stacks(run_dir, ranks, wait_s)
    for rank, text in stacks.items():
        print(f"=== rank {rank} (pid {ranks[rank]}) ===")
        print(text.rstrip() or "(no stack written: the rank may hold the interpreter lock; try --py-spy)")
    return 0
