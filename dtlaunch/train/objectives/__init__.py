"""Training objectives beside next-token cross-entropy, one file each: the DPO family (objective=dpo / orpo /
simpo: dpo.py), KTO (kto.py), the reward model (reward.py), GRPO (rollout.py, its formulas in grpo.py).
What they share: the completion log-probs (logps.py), the reference's (reference.py), the step data
(step_data.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.train.objectives.dpo import STATS_LEN, PreferenceObjective, summarize

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig

__all__ = ["STATS_LEN", "PreferenceObjective", "build_objective", "summarize"]


def build_objective(cfg: JobConfig, dec: Decisions, cp_group: Optional[Any]) -> Optional[Any]:
    """The job's objective, one builder per objective.name (None for sft: the loop's own cross-entropy). The
    loop and the step call what it returns without asking which one it is."""
    name = str(cfg.objective.name)
    if name == "grpo":
        from dtlaunch.train.objectives.rollout import GRPOObjective

        return GRPOObjective.of(cfg, dec.grad_accum)
    if name == "reward":
        from dtlaunch.train.objectives.reward import RewardObjective

        return RewardObjective.of(cfg)
    return PreferenceObjective.of(cfg, cp_group)  # dpo, orpo, simpo, kto; None for sft
