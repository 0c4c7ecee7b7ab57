"""The names of a run directory's files, and the one way from a checkpoint back to its run: torch-free, for
the launcher that writes them (dtlaunch.launch.rundir), the workers, and the commands that read a run.

RUN/config.yaml (the resolved job), RUN/state.json (the launcher's state), RUN/metrics.jsonl, RUN/logs/,
RUN/tokenizer/tokenizer.json (the launcher's copy of the run's tokenizer). A checkpoint lies somewhere below
its run (RUN/<checkpoint.dir>/step-N), so its run is the nearest directory above it holding either file the
launcher writes there first: config.yaml, or the kept tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONFIG_NAME = "config.yaml"
STATE_NAME = "state.json"
METRICS_NAME = "metrics.jsonl"
LOGS_DIR = "logs"
TOKENIZER_DIR = "tokenizer"
# A Hugging Face tokenizer's file, in a model directory as in RUN/tokenizer/.
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: Path) -> Path:
    """The tokenizer.json a path names: the directory's own, or the path itself when it is not a directory."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def tokenizer(self) -> Path:
        """The run's tokenizer as the launcher kept it (absent for the byte tokenizer and older runs)."""
        return self.path / TOKENIZER_DIR / TOKENIZER_FILE

    def rank_log(self, rank: int) -> Path:
        """RUN/logs/rank<R>.log: the worker's stderr (and stdout, but rank 0's), for as long as it lives."""
        return self.path / LOGS_DIR / f"rank{rank}.log"

    def is_run(self) -> bool:
        return self.config.is_file() or self.tokenizer.is_file()

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> Optional[RunDir]:
        """The run a checkpoint directory belongs to: the nearest directory above it holding the run's
        config.yaml or kept tokenizer (any depth: checkpoint.dir may be nested), or None (a checkpoint copied
        out of its run). Its config.yaml may still be missing: readers of the config check it."""
        return next((run for run in map(cls, Path(checkpoint).parents) if run.is_run()), None)
