"""One micro-batch as the training step reads it: the token rows and every per-row value beside them.

Every source of micro-batches (the worker's TokenLoader, a GRPO rollout's RolloutBatches, the planner's
RandomBatches, the tests' seeded batches) returns a MicroBatch from `next_batch`, and the step, the
reference models and the objectives read its fields: nothing about a batch is left on its loader, so a
value cannot belong to an earlier batch than the tokens it is used with, and a wrapper (the profiler's
labelled loader) cannot hide one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch


@dataclass(frozen=True)
class RolloutRows:
    """objective=grpo: a rollout's per-row values for the rows of one micro-batch (dtlaunch.train.objectives.grpo)."""

    adv: torch.Tensor  # (rows,) advantages
    step_tokens: torch.Tensor  # the generation batch's loss tokens over all ranks / dp
    old: Optional[torch.Tensor] = None  # (rows, seq) old-policy log-probs (num_iterations > 1)
    ref: Optional[torch.Tensor] = None  # (rows, seq) reference log-probs (beta > 0)
    # (rows, seq | 1) the sampler correction's weights (objective.importance_sampling_correction)
    is_ratio: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class MicroBatch:
    """(rows, seq) int64 inputs and targets (targets that do not count hold the ignore index), on the host
    (a rollout's: on the device), and the optional per-row values of the objective in use."""

    inputs: torch.Tensor
    targets: torch.Tensor
    # Masked (chat) data: the factor that turns this micro-batch's summed target loss into its share of the
    # global batch's mean (dtlaunch.train.data.TokenLoader); None for unmasked data (a plain mean is exact).
    loss_weight: Optional[float] = None
    # Extra model inputs: per-document positions and document ids (data.document_mask), or the positions of
    # this rank's chunks of each sequence (context parallel).
    model_args: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # The sample indices of the rows (the reference precompute pass stores its values by sample).
    indices: tuple[int, ...] = ()
    # Preference pairs with precomputed reference log-probs: the (2B,) values, chosen rows then rejected.
    ref_logps: Optional[torch.Tensor] = None
    # objective=kto: (B,) bool, each example's label (desirable: true).
    labels: Optional[torch.Tensor] = None
    # objective=reward with data.margin_field: (B,) float32, each pair's margin.
    margins: Optional[torch.Tensor] = None
    # objective=grpo: the rollout's values for these rows.
    rollout: Optional[RolloutRows] = None

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The extra model inputs on `device`, as the policy's and the reference's forwards take them."""
        return {k: v.to(device) for k, v in self.model_args.items()}
