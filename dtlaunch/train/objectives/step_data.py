"""What an objective's steps read: its loaders and, for objective=grpo, the rollout that turns prompts into
the rows each step trains on. Each objective object names its own (`step_data`, below for the token
objectives, dtlaunch.train.objectives.rollout for GRPO), so the loop (dtlaunch.train.trainer) builds its data
without asking which objective it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.train.data import build_loaders
from dtlaunch.train.parallel.mesh import cp_rank_size

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass
class StepData:
    loader: Any  # the training rows (a TokenLoader, or objective=grpo's PromptLoader)
    val_loader: Optional[Any]  # None: no validation split (and none for objective=grpo)
    rollout: Optional[Any] = None  # objective=grpo: its Rollout (dtlaunch.train.objectives.rollout), once per step


def token_data(cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
    """Token rows from the prepared shards: the next-token loss (sft.py) and the objectives
    that score rows (DPO / ORPO / SimPO / KTO pairs, the reward model's), with the reference's log-probs
    computed once before training where objective.precompute_reference asks."""
    loader, val_loader = build_loaders(cfg, run_dir, dp_rank, dp_size, *cp_rank_size(rt.mesh))
    if rt.objective is not None and bool(cfg.objective.precompute_reference):
        from dtlaunch.train.objectives.precompute import precomputed_reference

        loader.ref_logps = precomputed_reference(cfg, run_dir, rt, loader)
    return StepData(loader, val_loader)
