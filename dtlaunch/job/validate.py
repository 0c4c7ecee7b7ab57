"""Cross-field rules in one order: the section rules (dtlaunch.job.rules.<section>, each a small function
raising a ConfigError that names key, value and fix) after the numeric ranges (dtlaunch.job.ranges).

`validate(cfg)` runs them in a fixed order and returns the job's decisions (config.decisions.Decisions: the
resolved layout and what follows from it, decided once) plus notes worth showing (things that are allowed but
surprising, like an uneven pipeline split).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.job.ranges import check_ranges
from dtlaunch.job.rules.checkpoint import check_checkpoint
from dtlaunch.job.rules.data import check_data
from dtlaunch.job.rules.grpo import check_grpo_layout
from dtlaunch.job.rules.launch import check_cluster, check_hardware, check_launch
from dtlaunch.job.rules.long_context import check_mlp_tiles, check_residual_dtype
from dtlaunch.job.rules.model import check_model_layout, check_model_shape
from dtlaunch.job.rules.objective import check_kto_layout, check_objective, check_reward_layout
from dtlaunch.job.rules.offload import check_offload
from dtlaunch.job.rules.optim import check_optim
from dtlaunch.job.rules.peft import check_peft, check_target_experts_layout
from dtlaunch.job.rules.precision import check_float8_tensor_parallel, check_precision
from dtlaunch.job.rules.qlora import check_qlora
from dtlaunch.job.rules.run import check_logging, check_profiling, check_run_name
from dtlaunch.job.rules.strategy import (
    check_context_parallel,
    check_expert_parallel,
    check_layout,
    check_moe_tensor_parallel,
    check_pipeline,
    check_tensor_parallel,
    check_zero,
)
from dtlaunch.job.rules.training import check_batch, check_training

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass
class Validated:
    decisions: Decisions
    notes: list[str] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        return self.decisions.layout


SIMPLE_RULES: list[Callable[[Any, list[str]], None]] = [
    # The numeric ranges (one table next to the schema, job/ranges.py) first: the rules below may
    # divide by or index with these values.
    check_ranges,
    check_model_shape,
    check_precision,
    check_training,
    check_checkpoint,
    check_data,
    check_logging,
    check_hardware,
    check_launch,
    check_cluster,
    check_profiling,
    check_run_name,
    check_peft,
    check_objective,
]
LAYOUT_RULES: list[Callable[[Any, Decisions, list[str]], None]] = [
    check_model_layout,
    check_zero,
    check_moe_tensor_parallel,
    check_tensor_parallel,
    check_context_parallel,
    check_pipeline,
    check_expert_parallel,
    check_batch,
    check_grpo_layout,
    check_kto_layout,
    check_reward_layout,
    check_float8_tensor_parallel,
    check_qlora,
    check_target_experts_layout,
    check_offload,
    check_mlp_tiles,
    check_residual_dtype,
    check_optim,
]


def validate(cfg: JobConfig) -> Validated:
    """Run every rule; the first violation raises ConfigError (exit 2)."""
    notes: list[str] = []
    for rule in SIMPLE_RULES:
        rule(cfg, notes)
    decisions = Decisions.of(cfg, check_layout(cfg, notes))
    for layout_rule in LAYOUT_RULES:
        layout_rule(cfg, decisions, notes)
    return Validated(decisions=decisions, notes=notes)
