"""hardware, launch and cluster: where the workers start."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_hardware(cfg: JobConfig, notes: list[str]) -> None:
    if cfg.hardware.memory_gib <= 0:
        raise ConfigError(
            f"hardware.memory_gib={cfg.hardware.memory_gib} must be > 0: pick a profile, e.g. hardware=h100_80gb"
        )


def check_launch(cfg: JobConfig, notes: list[str]) -> None:
    la = cfg.launch
    if la.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"launch.backend='{la.backend}' is unknown: use auto, gloo or nccl")
    if la.nnodes > 1 and not la.rdzv_endpoint and cfg.cluster.kind == "local":
        raise ConfigError(
            f"launch.nnodes={la.nnodes} needs a rendezvous: set launch.rdzv_endpoint=HOST:PORT (the first node)"
        )
    if la.timeout_s <= 0:
        raise ConfigError(f"launch.timeout_s={la.timeout_s} must be > 0")
    if cfg.cluster.kind not in ("local", "slurm", "kubernetes", "skypilot"):
        raise ConfigError(
            f"cluster.kind='{cfg.cluster.kind}' is unknown: use cluster=local, slurm, kubernetes or skypilot"
        )
    if cfg.debug.fail_mode not in ("raise", "sigkill", "input"):  # fault injection: how the rank fails
        raise ConfigError(f"debug.fail_mode='{cfg.debug.fail_mode}' is unknown: use raise, sigkill or input")


# Slurm's time limit formats (sbatch --time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
SLURM_TIME = re.compile(r"(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE)", re.IGNORECASE)


def check_cluster(cfg: JobConfig, notes: list[str]) -> None:
    # sbatch would refuse a malformed limit only after the run directory exists, and for the evaluation
    # job only after the training job was already submitted: refuse it here.
    if cfg.cluster.kind != "slurm":
        return
    for key in ("time", "eval_time"):
        value = str(getattr(cfg.cluster, key))
        if value and not SLURM_TIME.fullmatch(value):
            raise ConfigError(
                f"cluster.{key}={value!r} is not a Slurm time limit: write HH:MM:SS or D-HH:MM:SS "
                f"(e.g. cluster.{key}=02:00:00), or '' for the partition's default"
            )
