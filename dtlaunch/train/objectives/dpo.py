"""The DPO family in one file: DPO (with TRL's sigmoid / ipo / hinge / robust losses), ORPO and SimPO as its
loss variants, and the objective the step calls for them (`PreferenceObjective`).

A preference micro-batch holds pairs (chosen rows, then rejected rows); the loss comes from the completion
log-probs (train/loss.py) scored here, with the reference's log-probs (reference.py) for DPO. Each micro-step's
loss is the mean over its pairs; every micro-batch holds the same number of pairs, so the sum over
micro-steps / accum, averaged over ranks, is the mean over the global batch. Under context parallel every
CP rank computes the whole loss of its pairs (the log-probs are summed over the CP group first, train/loss.py).

DPO as TRL 1.16 computes it (trl/trainer/dpo_trainer.py): the margin is Δ = [logp(y+) - ref(y+)] -
[logp(y-) - ref(y-)]. label_smoothing: only `robust` uses it, as TRL >= 0.29 (its sigmoid loss ignores it).
torchtune applies it to sigmoid as "conservative DPO", -(1-ε) log σ(βΔ) - ε log σ(-βΔ); that is not offered.
ORPO (Hong et al., 2024) as TRL's ORPOTrainer: length-averaged log-probs, loss = NLL of the chosen completion
(mean over its tokens) - β log σ(log-odds ratio); no reference model. SimPO (Meng et al., 2024) as TRL's
CPOTrainer(loss_type="simpo", cpo_alpha=0): -log σ(β Δavg - γ) of length-averaged log-probs; no reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from dtlaunch.train.loss import TokenNLL, completion_logps
from dtlaunch.train.objectives.step_data import StepData, token_data

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    loss: str,
    beta: float,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward); rewards are β × the log-ratios, detached."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        per_pair = -F.logsigmoid(beta * delta)
    elif loss == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    elif loss == "ipo":
        # Length-normalised, as TRL (confirmed with the IPO authors): token sums make the square scale with length.
        avg = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        per_pair = (avg - 1 / (2 * beta)) ** 2
    elif loss == "robust":
        eps = label_smoothing
        per_pair = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")
    return per_pair, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair odds-ratio term to subtract, chosen reward, rejected reward) from per-token average log-probs."""
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    return beta * F.logsigmoid(log_odds), beta * chosen_avg.detach(), beta * rejected_avg.detach()


def simpo_losses(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward) from per-token average log-probs."""
    logits = (chosen_avg - rejected_avg) - gamma / beta
    return -F.logsigmoid(beta * logits), beta * chosen_avg.detach(), beta * rejected_avg.detach()


# Logged per step: means over the step's pairs (all ranks), TRL's names.
STAT_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
STATS_LEN = len(STAT_NAMES) + 1  # the sums, then the number of pairs


@dataclass
class PreferenceObjective:
    """objective.* read once (the step calls this every micro-step)."""

    name: str
    loss: str
    beta: float
    label_smoothing: float
    sft_weight: float
    gamma: float
    cp_group: Optional[Any] = None  # context parallel: the group holding the other chunks of each row

    @classmethod
    def of(cls, cfg: JobConfig, cp_group: Optional[Any] = None) -> PreferenceObjective:
        """objective=dpo, orpo or simpo (dtlaunch.train.objectives.build_objective builds the others)."""
        o = cfg.objective
        return cls(
            name=str(o.name),
            loss=str(o.loss),
            beta=float(o.beta),
            label_smoothing=float(o.label_smoothing),
            sft_weight=float(o.sft_weight),
            gamma=float(o.gamma),
            cp_group=cp_group,
        )

    stats_len = STATS_LEN

    @staticmethod
    def summarize(stats: list[float]) -> dict[str, float]:
        return summarize(stats)

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
        return token_data(cfg, run_dir, rt, dp_rank, dp_size)  # pairs of rows from the prepared shards

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's call (dtlaunch.train.objectives.Objective): `ref`, the reference's log-probs of the
        rows (computed beside the step, or precomputed on the batch)."""
        loss, stats = self(output, targets, ref, loss_fn.token_nll)
        return loss / accum, stats

    def pipeline_rows(
        self, rt: Any, batch: MicroBatch, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs kept whole in each pipeline micro-batch, the reference's log-probs in the targets
        (dtlaunch.train.objectives.pipeline)."""
        from dtlaunch.train.objectives.pipeline import pipeline_batch

        return pipeline_batch(rt, batch, inputs, targets)

    def pipeline_loss(self, loss: Any) -> Any:
        """The last stage's loss under pipeline parallel: this objective on each pipeline micro-batch's pairs,
        scaled as the schedule's next-token loss `loss` is, through its head."""
        from dtlaunch.train.objectives.pipeline import PreferencePipelineLoss

        return PreferencePipelineLoss(self, loss.scale, self.needs_reference, head=loss.loss_fn)

    def __call__(
        self,
        output: torch.Tensor,
        targets: torch.Tensor,
        ref_logps: Optional[torch.Tensor],
        token_nll: Optional[TokenNLL] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over this micro-batch's pairs, the STATS_LEN summed statistics, detached).
        `output`: the logits, or the hidden states that `token_nll` (the chunked head) scores;
        `ref_logps`: the reference's (2B,) completion log-probs (DPO only)."""
        comp = completion_logps(output, targets, self.cp_group, token_nll)
        (c, r), (nc, nr) = comp.halves(comp.logps), comp.halves(comp.tokens)
        chosen_nll = -c.sum() / nc.sum().clamp(min=1)  # mean over every chosen completion token (TRL's "sft")
        if self.name == "dpo":
            assert ref_logps is not None
            rc, rr = ref_logps.chunk(2, dim=0)
            per_pair, rew_c, rew_r = dpo_losses(c, r, rc, rr, nc, nr, self.loss, self.beta, self.label_smoothing)
            loss = per_pair.mean() + (self.sft_weight * chosen_nll if self.sft_weight > 0 else 0.0)
            logged_c, logged_r = c, r
        else:
            # ORPO and SimPO score per-token averages (TRL: average_log_prob=True).
            logged_c, logged_r = c / nc.clamp(min=1), r / nr.clamp(min=1)
            if self.name == "orpo":
                ratio, rew_c, rew_r = orpo_losses(logged_c, logged_r, self.beta)
                loss = chosen_nll - ratio.mean()
            else:
                per_pair, rew_c, rew_r = simpo_losses(logged_c, logged_r, self.beta, self.gamma)
                loss = per_pair.mean()
        stats = torch.stack(
            [
                rew_c.sum(),
                rew_r.sum(),
                (rew_c - rew_r).sum(),
                (rew_c > rew_r).float().sum(),
                logged_c.detach().sum(),
                logged_r.detach().sum(),
                torch.tensor(float(c.numel()), device=c.device),
            ]
        )
        return loss, stats


def summarize(stats: list[float]) -> dict[str, float]:
    """Metrics-line values from a step's STATS_LEN sums (over micro-steps and ranks)."""
    pairs = stats[-1] or 1.0
    return {name: value / pairs for name, value in zip(STAT_NAMES, stats[:-1], strict=True)}
