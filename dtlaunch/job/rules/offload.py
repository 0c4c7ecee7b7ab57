"""Rules for the offloading switches (`training.activation_offload`, `strategy.cpu_offload`): the
combinations the runtime does not support are refused in one line before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.decisions import offload_composes_with_compile
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.config.schema import JobConfig


def check_offload(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    t, s = cfg.training, cfg.strategy
    # Only an explicit true is checked: the default (null) turns offload on only where these rules allow it.
    if (t.activation_offload or s.cpu_offload) and float(cfg.hardware.host_memory_gib) == 0:
        key = "training.activation_offload" if t.activation_offload else "strategy.cpu_offload"
        raise ConfigError(
            f"{key}=true is planned against host RAM, but hardware.host_memory_gib=0 (unknown): "
            f"set hardware.host_memory_gib=<GiB of RAM per node>"
        )
    if t.activation_offload:
        _check_activation_offload(cfg, d.layout)
    if s.cpu_offload:
        _check_cpu_offload(cfg, d.layout)


def _check_activation_offload(cfg: JobConfig, layout: Layout) -> None:
    t = cfg.training
    if t.compile and not offload_composes_with_compile(t.activation_checkpointing):
        # Each block is compiled inside its checkpoint wrapper, the hooks outside it: every block must be
        # checkpointed whole for the hooks to see only block inputs (config.decisions).
        raise ConfigError(
            f"training.activation_offload=true with training.compile=true needs "
            f"training.activation_checkpointing=full, not {t.activation_checkpointing} (the offload hooks "
            f"run outside the compiled blocks, around their checkpoints): set "
            f"training.activation_checkpointing=full (or training.compile=false)"
        )
    if layout.pp > 1:
        raise ConfigError(
            f"training.activation_offload=true is not supported with strategy.pp={layout.pp}: "
            f"use strategy.pp=1 (or training.activation_offload=false)"
        )


def _check_cpu_offload(cfg: JobConfig, layout: Layout) -> None:
    """FSDP2's CPUOffloadPolicy, on any number of data-parallel ranks: on one, FSDP shards nothing and only
    keeps the parameters, gradients and optimizer state on the host (config.decisions.Decisions.fsdp)."""
    s = cfg.strategy
    if int(s.zero_stage) < 2:
        raise ConfigError(
            f"strategy.cpu_offload=true needs FSDP, but strategy.zero_stage={s.zero_stage} (DDP keeps its "
            f"replicas on the device): set strategy.zero_stage=2 or 3"
        )
    for key, value in (("strategy.tp", layout.tp), ("strategy.pp", layout.pp), ("strategy.ep", layout.ep)):
        if value > 1:
            raise ConfigError(
                f"strategy.cpu_offload=true is supported with plain FSDP only, not {key}={value}: "
                f"set {key}=1 (or strategy.cpu_offload=false)"
            )
    if cfg.precision.float8 != "none":
        raise ConfigError(
            f"strategy.cpu_offload=true does not combine with precision.float8={cfg.precision.float8}: "
            f"set precision.float8=none"
        )
    if str(cfg.peft.method) == "qlora":
        raise ConfigError(
            "strategy.cpu_offload=true does not combine with peft.method=qlora (NF4 shards stay on the "
            "device): use peft.method=lora or strategy.cpu_offload=false"
        )
