"""Bad input a worker finds (a corrupt data window, a checkpoint that does not fit the model) is still
bad input: the worker leaves a small record in the run's logs and exits with EXIT_BAD_INPUT, and the
launcher turns that record into the same one-line error and exit 2 it gives for what it checks itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn, Optional

from dtlaunch.errors import EXIT_BAD_INPUT
from dtlaunch.run.run_dir import LOGS_DIR

PATTERN = "input-error-rank*.json"


def _dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS_DIR


def clear(run_dir: Path) -> None:
    """Before a launch: records of an earlier attempt must not be read as this one's."""
    for f in _dir(run_dir).glob(PATTERN):
        f.unlink(missing_ok=True)


def exit_with_input_error(run_dir: Path, rank: int, message: str) -> NoReturn:
    """Worker side: record the message and end this process with exit 2 (no barrier: peers may be
    inside a collective; torchrun stops them)."""
    path = _dir(run_dir) / f"input-error-rank{rank}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank, "message": message}))
        tmp.replace(path)
    except OSError:
        pass  # the launcher still reports rank and exit code
    print(f"input error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_BAD_INPUT)


def read(run_dir: Path) -> Optional[str]:
    """Launcher side: the lowest rank's recorded message, or None."""
    found = []
    for f in _dir(run_dir).glob(PATTERN):
        try:
            data = json.loads(f.read_text())
            found.append((int(data["rank"]), str(data["message"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return min(found)[1] if found else None
