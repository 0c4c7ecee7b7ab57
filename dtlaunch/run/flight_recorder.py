"""torch's collective flight recorder, the launcher's side (no torch): the variables that turn it on for
the workers and where their records go. The workers' side (dumping) is dtlaunch.train.observe.flight_recorder.

The recorder keeps the last launch.flight_recorder_entries collectives of each rank (group, sequence number,
sizes, the Python stack that issued it) in a ring buffer; torch fills it when TORCH_FR_BUFFER_SIZE is set
before the process group starts. Records are files named TORCH_FR_DUMP_TEMP_FILE + rank, which is the
layout torch's analyser (`torchfrtrace DIR`) reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
PREFIX_ENV = "TORCH_FR_DUMP_TEMP_FILE"
DIR_NAME = "flight_recorder"
FILE_PREFIX = "rank_"  # the analyser reads the rank from the digits after a common prefix


def launch_env(entries: int, run_dir: Path) -> dict[str, str]:
    """Variables for the workers (torch reads them when the process group starts); {} when off."""
    if entries <= 0:
        return {}
    return {
        BUFFER_ENV: str(entries),
        PREFIX_ENV: str(Path(run_dir) / DIR_NAME / FILE_PREFIX),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # NCCL's watchdog writes the same files itself
    }


def clear(run_dir: Path) -> None:
    """Before a launch: an earlier launch's records must not be analysed with this one's."""
    for f in (Path(run_dir) / DIR_NAME).glob(f"{FILE_PREFIX}*"):
        f.unlink(missing_ok=True)


def dump_dir() -> Optional[Path]:
    """Where this run's records go (from the workers' environment), or None when the recorder is off."""
    prefix = os.environ.get(PREFIX_ENV, "")
    if int(os.environ.get(BUFFER_ENV, "0") or 0) <= 0 or not prefix:
        return None
    return Path(prefix).parent


def analyse_command(directory: Path) -> str:
    return f"torchfrtrace {directory}"
