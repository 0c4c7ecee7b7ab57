"""Next-token cross-entropy (objective=sft, and pre-training): the loss of every token row the prepared
shards hold, as transformers' and torchtitan's causal-LM loss computes it.

The rows come from the prepared shards (step_data.token_data). Each micro-step's loss is its share of the
global batch's mean over the tokens that count (targets equal to -100, a chat's prompt and padding, do
not):
- unmasked rows (plain text, packed documents): every micro-batch holds as many counted tokens, so the
  micro-batch's token mean / accum is that share exactly;
- masked rows (chat data): micro-batches count different numbers of tokens, so the loader hands each one the
  factor (MicroBatch.loss_weight, dtlaunch.train.data.TokenLoader) that turns its summed token loss into
  its share of the mean over every counted target of the global batch, whatever the layout and the
  accumulation.

The cross-entropy itself, in every form the layout needs (full logits, chunked head, loss parallel), is
the runtime's HeadLoss (dtlaunch.train.loss); this module decides what is summed and how it is scaled.
Under pipeline parallel the last stage's PipelineLoss applies the same mean (dtlaunch.train.loss).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from dtlaunch.train.objectives.step_data import StepData, token_data

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch


class NextTokenObjective:
    """objective=sft in the step: no reference, no statistics beside the loss."""

    name = "sft"
    needs_reference = False
    stats_len = 0

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
        return token_data(cfg, run_dir, rt, dp_rank, dp_size)

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(this micro-step's share of the step's loss, no statistics). `output`: the logits, or the hidden
        states the chunked head scores (`loss_fn`, the runtime's HeadLoss)."""
        weight = batch.loss_weight
        if weight is None:
            return loss_fn(output, targets) / accum, None
        # One product with the folded factor: the bits of the loss (and so of every gradient) do not
        # depend on how the factor was split.
        return loss_fn(output, targets, reduction="sum") * (weight / accum), None

    def pipeline_rows(
        self, rt: Any, batch: MicroBatch, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows go to the pipeline schedule as they are (its micro-batches are any run of rows)."""
        return inputs, targets

    def pipeline_loss(self, loss: Any) -> Any:
        """The last stage's loss under pipeline parallel: the schedule's next-token loss as it is."""
        return loss

    @staticmethod
    def summarize(stats: list[float]) -> dict[str, float]:
        return {}
