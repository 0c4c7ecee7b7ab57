"""run, logging and profiling: what a run writes and where."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.job.rules import need_package

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_logging(cfg: JobConfig, notes: list[str]) -> None:
    for tracker in cfg.logging.trackers:
        name = str(tracker)
        need_package(
            {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name],
            f"logging.trackers includes {name}, which",
            name,
        )
    if cfg.logging.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logging.wandb.mode='{cfg.logging.wandb.mode}' is unknown: use offline, online or disabled")


def check_profiling(cfg: JobConfig, notes: list[str]) -> None:
    pr, steps = cfg.profiling, int(cfg.training.steps)
    if not pr.enabled:
        return
    if not any(1 <= int(s) <= steps for s in pr.steps) and not 0 < pr.every <= steps:
        raise ConfigError(
            f"profiling.steps={list(pr.steps)} / profiling.every={pr.every} profile no step of "
            f"training.steps={steps}: list steps in 1..{steps}, e.g. profiling.steps=[{min(3, steps)}]"
        )


def check_run_name(cfg: JobConfig, notes: list[str]) -> None:
    # run.name names a directory under run.root ('group/name' is fine): an absolute name or a '..' part
    # would put the run, and every file it writes, outside run.root.
    name = str(cfg.run.name)
    if name.startswith(("/", os.sep)) or ".." in name.replace(os.sep, "/").split("/") or "\0" in name:
        raise ConfigError(
            f"run.name={name!r} would put the run outside run.root: use a relative name without '..' "
            f"(or set run.dir=<path> for a directory elsewhere)"
        )
