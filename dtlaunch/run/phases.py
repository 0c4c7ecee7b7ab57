"""One line on the user's terminal when a run enters a slow phase, so a silent start is never a mystery.

Only global rank 0 prints (its stdout is the terminal; other ranks' goes to their log files).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional


def phase(what: str) -> None:
    """`[dtlaunch] <what>` on rank 0's stdout, flushed at once (the worker may then be busy for seconds)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[dtlaunch] {what}", flush=True)


def rank_log(msg: str) -> None:
    """A timestamped line in this rank's log file (a worker's stderr is redirected there)."""
    print(f"[{time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def startup_stamp(what: str, at: Optional[float] = None) -> None:
    """`startup: <what> at <epoch seconds>` in this rank's log: when each phase of a start ended, on the wall
    clock, which is comparable across the launcher's and the workers' processes (bench/launch_time.py)."""
    rank_log(f"startup: {what} at {time.time() if at is None else at:.3f}")
