"""checkpoint: where and how often a run saves."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_checkpoint(cfg: JobConfig, notes: list[str]) -> None:
    c = cfg.checkpoint
    if c.every_steps <= 0:
        raise ConfigError(
            f"checkpoint.every_steps={c.every_steps} must be > 0 (use checkpoint=none to turn saving off)"
        )
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    if c.load_path and not os.path.isdir(c.load_path):
        raise ConfigError(
            f"checkpoint.load_path='{c.load_path}' is not a directory: give a checkpoints/step-* directory"
        )
