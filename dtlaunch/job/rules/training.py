"""training: the batch arithmetic, sequence length and activation checkpointing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig, TrainingConfig


def check_batch(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    gb, dp = d.global_batch, d.layout.dp
    per_step = cfg.training.micro_batch * dp
    if gb % per_step:
        raise ConfigError(
            f"training.global_batch={gb} is not divisible by micro_batch x dp = {cfg.training.micro_batch} x "
            f"{dp} = {per_step}: set training.global_batch to a multiple of {per_step}"
        )


def check_training(cfg: JobConfig, notes: list[str]) -> None:
    t = cfg.training
    check_ac_options(t)
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len} of "
            f"{cfg.model.name}: lower training.seq_len"
        )


def check_ac_options(t: TrainingConfig) -> None:
    """The selective-AC knobs: a budget that needs compile and selective mode (the policy is a schema choice)."""
    budget = float(t.ac_memory_budget)  # its range [0, 1] and ac_every_n_layers >= 1: job.ranges
    if budget > 0 and not t.compile:
        raise ConfigError(
            f"training.ac_memory_budget={budget:g} is applied by torch.compile's partitioner: set "
            "training.compile=true, or use training.ac_policy=op|layer without a budget"
        )
    if budget > 0 and t.activation_checkpointing != "selective":
        raise ConfigError(
            f"training.ac_memory_budget={budget:g} is a selective mode: set "
            f"training.activation_checkpointing=selective (it is '{t.activation_checkpointing}')"
        )
