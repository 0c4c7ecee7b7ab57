"""Reward-model training (objective=reward), as TRL 1.16's RewardTrainer (trl/trainer/reward_trainer.py).

The model: the decoder's LM head gives way to `score`, a Linear(dim, 1, bias=False) under the name and shape
of transformers' *ForSequenceClassification head (dtlaunch.models.score_head), so `dtlaunch ckpt export
--format hf` writes a directory that AutoModelForSequenceClassification loads (dtlaunch.convert.hf). It
runs inside the model's forward, which returns (rows, positions, 1) scores: no vocabulary logits.

A row's reward is its score at the last token that is not padding, as transformers' sequence classification
picks it (the rightmost position whose token is not `pad_token_id`). The pairs are right-padded with EOS
(dtlaunch.data.preference.PairSource), so the pad id is EOS, TRL's choice for a tokenizer without a pad
token; the export writes it as config.json's pad_token_id. The objective sees the targets, not the inputs:
input position p holds the token of target p - 1, and every completion token is a target, so the last
non-pad token of the completion is read off the targets.

The loss of a micro-batch (pairs: chosen rows, then rejected rows), as TRL's compute_loss:
-log sigmoid(r+ - r- - margin) averaged over its pairs (margin: a per-pair column, 0 without one), plus
center_rewards_coefficient x mean((r+ + r-)^2) when set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from dtlaunch.train.data import IGNORE_INDEX
from dtlaunch.train.objectives.step_data import StepData, token_data

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch

# Logged per step: means over the step's pairs (all ranks). TRL's names (its per-batch means averaged over a
# logging window are these means when every batch holds as many pairs), then the two sides' mean rewards.
STAT_NAMES = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")
STATS_LEN = len(STAT_NAMES) + 1  # the sums, then the number of pairs


def reward_positions(targets: torch.Tensor, pad_id: Optional[int]) -> torch.Tensor:
    """(R,) input position of each row's last token that is not `pad_id` (None: no padding, rows are full).
    Input position p (1 <= p < S) holds target p - 1's token; the completion's tokens are all targets. A row
    whose completion is padding only ends at its last prompt token: the position before its first target."""
    valid = targets != IGNORE_INDEX
    keep = valid[:, :-1]
    if pad_id is not None:
        keep = keep & (targets[:, :-1] != pad_id)
    positions = torch.arange(1, targets.shape[1], device=targets.device)
    last = (keep * positions).amax(dim=1)
    first_target = valid.int().argmax(dim=1)
    return torch.where(keep.any(dim=1), last, first_target)


def row_rewards(scores: torch.Tensor, targets: torch.Tensor, pad_id: Optional[int]) -> torch.Tensor:
    """(R,) fp32 rewards from the model's (R, S, 1) scores."""
    pos = reward_positions(targets, pad_id)
    return scores.squeeze(-1).float().gather(1, pos[:, None]).squeeze(1)


@dataclass
class RewardObjective:
    """objective.* read once (the step calls this every micro-step)."""

    center_rewards_coefficient: Optional[float]
    pad_id: Optional[int] = None  # the data's padding token (step_data); None: synthetic rows, never padded

    name = "reward"
    needs_reference = False
    stats_len = STATS_LEN

    @classmethod
    def of(cls, cfg: JobConfig) -> RewardObjective:
        c = cfg.objective.center_rewards_coefficient
        return cls(center_rewards_coefficient=None if c is None else float(c))

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
        """Chosen / rejected pairs from the prepared shards; the score is read at each row's last token before
        the padding, so the pad id is taken from the pairs the loader reads (PairSource pads with EOS)."""
        data = token_data(cfg, run_dir, rt, dp_rank, dp_size)
        source = getattr(data.loader.source, "base", data.loader.source)
        pad = getattr(source, "pad", None)
        self.pad_id = None if pad is None else int(pad)
        return data

    @staticmethod
    def summarize(stats: list[float]) -> dict[str, float]:
        pairs = stats[-1] or 1.0
        return {name: value / pairs for name, value in zip(STAT_NAMES, stats[:-1], strict=True)}

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's call (dtlaunch.train.objectives.Objective): the pairs' margins ride on the batch; no
        reference, and the scores need no LM head."""
        loss, stats = self(output, targets, batch.margins)
        return loss / accum, stats

    def __call__(
        self, output: torch.Tensor, targets: torch.Tensor, margins: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over this micro-batch's pairs, the STATS_LEN summed statistics, detached). `output`: the
        model's (2B, S, 1) scores; `margins`: (B,) per-pair margins or None (data.margin_field)."""
        chosen, rejected = row_rewards(output, targets, self.pad_id).chunk(2, dim=0)
        diff = chosen - rejected
        if margins is not None:
            diff = diff - margins.to(diff.device, torch.float32)
        loss = -F.logsigmoid(diff).mean()
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        c, r = chosen.detach(), rejected.detach()
        stats = torch.stack(
            [
                (c > r).float().sum(),
                (c - r).sum(),
                ((c + r) / 2).sum(),  # / pairs: the mean over every row's reward (TRL's mean_reward)
                c.sum(),
                r.sum(),
                torch.tensor(float(c.numel()), device=c.device),
            ]
        )
        return loss, stats
