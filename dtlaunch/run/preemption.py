"""Preemption: SIGTERM / SIGUSR1 stop the run at a step boundary with a checkpoint, exit EXIT_PREEMPTED (75).

Workers: the handler only sets a flag (saving inside a handler would start collectives at an arbitrary
point). The signal may reach one rank (`kill PID`), some, or all (scancel, the launcher forwarding it), so
once per step boundary every rank contributes its flag to an all-reduce(MAX) of one integer: all ranks see
the same answer, stop after the same step, save that step and exit 75. Rank 0 then writes `preempted.json`
into the run directory (step, signal) for the launcher's one-line message.

Launcher (`dtlaunch train`, torchrun in-process): `forward_signals` handles SIGTERM / SIGUSR1 itself instead
of torchrun's agent, which would kill the workers after its 30 s shutdown timeout and, with
launch.max_restarts > 0, restart workers that exited to be preempted. It forwards the signal, waits (up to
launch.timeout_s) until the workers have saved and exited, then stops the agent without a restart. Workers
that were signalled directly tell the launcher (their parent) the same way, so a preempted run stops
whichever process got the signal.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Set by the launcher for the workers: the pid of the `dtlaunch train` process running torchrun's agent.
AGENT_PID_ENV = "DTLAUNCH_AGENT_PID"
MARKER = "preempted.json"

_requested = 0  # the signal number asked for (0: none)


class PreemptionStop(Exception):
    """Raised out of the training loop once the checkpoint of `step` is saved; the worker exits 75."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} after step {step}")
        self.step = step
        self.signum = signum


# ---------------------------------------------------------------------------------------------
# Worker side.


def _on_signal(signum: int, frame: Any) -> None:
    global _requested
    _requested = max(_requested, signum)


def install() -> None:
    """In a worker, first thing: SIGTERM and SIGUSR1 ask for a stop instead of killing the process."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def requested() -> int:
    return _requested


def stopping(signum: int) -> None:
    """All ranks agreed to stop for `signum` (see dtlaunch.train.step_sync.WindowSync): tell the launcher."""
    _notify_agent(signum)


def _notify_agent(signum: int) -> None:
    """Tell our launcher (only when it is the parent that set AGENT_PID_ENV) to stop instead of restarting."""
    agent = os.environ.get(AGENT_PID_ENV, "")
    if agent.isdigit() and int(agent) == os.getppid():
        os.kill(int(agent), signum)


def write_marker(run_dir: Path, step: int, signum: int) -> None:
    """Rank 0, after the checkpoint of `step` is complete."""
    data = {"step": step, "signal": signal.Signals(signum).name, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = Path(run_dir) / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, Path(run_dir) / MARKER)


# ---------------------------------------------------------------------------------------------
# Launcher side.


def read_marker(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, from /proc (Linux); [] where there is no /proc."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


@contextmanager
def forward_signals(grace_s: float) -> Iterator[None]:
    """Around torchrun's agent in this process: SIGTERM / SIGUSR1 -> forward to the workers, wait for them
    to save and exit (at most `grace_s`), then raise torch's SignalException so the agent shuts down
    without restarting. A repeated signal while waiting is ignored (the workers send one back)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    state = {"stopping": False}

    def handler(signum: int, frame: Any) -> None:
        if state["stopping"]:
            return
        state["stopping"] = True
        me = os.getpid()
        for child in _children(me):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while _children(me) and time.monotonic() < deadline:
            time.sleep(0.1)
        raise SignalException(f"Process {me} got signal: {signum}", sigval=signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(AGENT_PID_ENV, None)
        for sig, old in previous.items():
            signal.signal(sig, old)


def agent_signals() -> str:
    """torchrun's --signals-to-handle while `forward_signals` is active: everything but ours."""
    return "SIGINT,SIGHUP,SIGQUIT"
