"""Training objectives, one file each: next-token cross-entropy (objective=sft and pre-training: sft.py), the
DPO family (objective=dpo / orpo / simpo: dpo.py), KTO (kto.py), the reward model (reward.py), GRPO (grpo.py: its
advantages and loss; rollout.py: generation and rewards before each step). What they share: the completion log-probs (train/loss.py), the
reference's (reference.py), the step data (step_data.py).

Every objective is an `Objective`: the loop (dtlaunch.train.trainer) builds its data with `step_data` and
logs `summarize` of its statistics; the step (dtlaunch.train.step) calls `step_loss`. Neither asks which
objective it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.train.objectives.dpo import STATS_LEN, PreferenceObjective, summarize

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch
    from dtlaunch.train.objectives.step_data import StepData

__all__ = ["STATS_LEN", "Objective", "PreferenceObjective", "build_objective", "summarize"]


class Objective(Protocol):
    """What the loop and the step read of an objective."""

    name: str
    # Reference log-probs computed beside the step by a frozen copy (dtlaunch.train.objectives.reference).
    needs_reference: bool
    # The length of the summed statistics each micro-step returns (0: none), summed over micro-steps and
    # ranks by the loop and turned into metrics by `summarize`.
    stats_len: int

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
        """The loaders (and GRPO's rollout) the job's steps read."""
        ...

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(this micro-step's share of the step's loss, its statistics or None) from the model's `output`
        (the logits, or the hidden states `loss_fn`, the runtime's HeadLoss, scores chunk by chunk), the
        micro-batch and the reference's log-probs of its rows (None without a reference)."""
        ...

    def summarize(self, stats: list[float]) -> dict[str, float]:
        """Metrics-line values from a step's summed statistics."""
        ...


def build_objective(cfg: JobConfig, dec: Decisions, cp_group: Optional[Any]) -> Objective:
    """The job's objective, one builder per objective.name. The loop and the step call what it returns
    without asking which one it is. Objectives that run under pipeline parallel (sft, the DPO family) also
    have `pipeline_rows(rt, batch, inputs, targets)`, the rows as the schedule takes them, and
    `pipeline_loss(loss)`, the last stage's loss; the rules refuse pipeline parallel for the others
    (dtlaunch.job.rules.objective)."""
    name = cfg.objective.name
    if name == ObjectiveName.sft:
        from dtlaunch.train.objectives.sft import NextTokenObjective

        return NextTokenObjective()
    if name == ObjectiveName.grpo:
        from dtlaunch.train.objectives.grpo import GRPOObjective
        from dtlaunch.train.objectives.rollout import rollout_data

        return GRPOObjective.of(cfg, dec.grad_accum, rollout_data)
    if name == ObjectiveName.reward:
        from dtlaunch.train.objectives.reward import RewardObjective

        return RewardObjective.of(cfg)
    if name == ObjectiveName.kto:
        from dtlaunch.train.objectives.kto import KTOObjective

        return KTOObjective.of(cfg, cp_group)
    return PreferenceObjective.of(cfg, cp_group)  # dpo, orpo, simpo
