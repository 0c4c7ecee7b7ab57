"""KTO (Ethayarajh et al., 2024) as TRL 1.16's KTOTrainer computes it (trl/trainer/kto_trainer.py,
`_compute_loss`): unpaired completions, each desirable or not, scored against a reference model.

A KTO example is two rows, stacked as a preference pair's (train/loss.py): its own prompt + completion, and its
"KL row", its prompt + the completion of its predecessor in its run of training.micro_batch records
(dtlaunch.data.unpaired; TRL's `KL_completion_ids`). A micro-batch of B examples is 2B rows: the B own
rows, then the B KL rows; the loader hands each example's label (desirable: true) beside them. The KL rows
go through the policy's forward with the others (one forward, as DPO's rejected rows; TRL runs them in a
no-grad forward of their own): the KL estimate is detached, so their gradient is zero and the step is TRL's.

With r = logp - ref_logp (the reference's: reference.py, or precomputed) and the KL estimate
z0 = max(0, mean over the processes of the micro-batch's mean of the KL rows' r) (detached):
  loss=kto               desirable 1 - σ(β (r - z0)), undesirable 1 - σ(β (z0 - r));
  loss=apo_zero_unpaired desirable 1 - σ(β r),        undesirable σ(β r)  (z0 = 0; the KL rows unused);
weighted by objective.desirable_weight / undesirable_weight; the micro-step's loss is their mean over its
examples (TRL's nanmean). z0's mean over the processes is taken per micro-step, over every rank (data-
parallel ranks hold different examples; tensor- and context-parallel peers the same value, which a mean
over all of them leaves unchanged); pipeline parallel is refused (job/rules/objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from dtlaunch.train.loss import TokenNLL, completion_logps
from dtlaunch.train.objectives.step_data import StepData, token_data

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch

# The step's summed statistics: per side the reward and log-prob sums and the example count, then the
# micro-steps' KL estimates and their number (summed over micro-steps and ranks alike).
_SUMS = ("rewards/chosen", "logps/chosen", "chosen", "rewards/rejected", "logps/rejected", "rejected", "kl", "steps")
STATS_LEN = len(_SUMS)


def kto_losses(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, kl: torch.Tensor, loss: str, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(desirable examples' losses, undesirable ones') from their log-ratios to the reference."""
    if loss == "kto":
        return 1 - torch.sigmoid(beta * (chosen_logratios - kl)), 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    if loss == "apo_zero_unpaired":
        return 1 - torch.sigmoid(beta * chosen_logratios), torch.sigmoid(beta * rejected_logratios)
    raise ValueError(f"unknown KTO loss {loss!r}")


def kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0: the KL rows' mean log-ratio, averaged over every process (TRL's gather_for_metrics(...).mean()),
    clamped at 0; detached."""
    kl = (kl_logps - ref_kl_logps).mean().detach()
    if dist.is_initialized() and dist.get_world_size() > 1:
        kl = kl.clone()
        dist.all_reduce(kl)
        kl = kl / dist.get_world_size()
    return kl.clamp(min=0)


@dataclass
class KTOObjective:
    """objective.* of objective=kto, read once (the step calls it every micro-step)."""

    loss: str
    beta: float
    desirable_weight: float
    undesirable_weight: float
    cp_group: Optional[Any] = None  # context parallel: the group holding the other chunks of each row

    stats_len = STATS_LEN
    needs_reference = True

    @classmethod
    def of(cls, cfg: JobConfig, cp_group: Optional[Any] = None) -> KTOObjective:
        o = cfg.objective
        return cls(str(o.loss), float(o.beta), float(o.desirable_weight), float(o.undesirable_weight), cp_group)

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
        return token_data(cfg, run_dir, rt, dp_rank, dp_size)  # unpaired examples stacked as pairs

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's call (dtlaunch.train.objectives.Objective): each example's label rides on the batch."""
        loss, stats = self(output, targets, ref, loss_fn.token_nll, labels=batch.labels)
        return loss / accum, stats

    def __call__(
        self,
        output: torch.Tensor,
        targets: torch.Tensor,
        ref_logps: Optional[torch.Tensor],
        token_nll: Optional[TokenNLL] = None,
        labels: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over this micro-batch's examples, the STATS_LEN summed statistics, detached).
        `ref_logps`: the reference's (2B,) log-probs of the same rows; `labels`: (B,) bool, desirable."""
        assert ref_logps is not None and labels is not None
        comp = completion_logps(output, targets, self.cp_group, token_nll)
        logps, kl_logps = comp.halves(comp.logps)
        ref, ref_kl = ref_logps.to(logps.dtype).chunk(2, dim=0)
        good = labels.to(device=logps.device, dtype=torch.bool)
        if self.loss == "kto":
            kl = kl_estimate(kl_logps, ref_kl)
        else:
            kl = torch.zeros((), device=logps.device)
        logratios = logps - ref
        chosen, rejected = logratios[good], logratios[~good]
        chosen_losses, rejected_losses = kto_losses(chosen, rejected, kl, self.loss, self.beta)
        losses = torch.cat((self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses))
        loss = losses.nanmean()
        d = logps.detach()
        stats = torch.stack(
            [
                (self.beta * chosen.detach()).sum(),  # as TRL: the rewards summed
                d[good].sum(),
                good.sum().to(d.dtype),
                (self.beta * rejected.detach()).sum(),
                d[~good].sum(),
                (~good).sum().to(d.dtype),
                kl.to(d.dtype),
                torch.ones((), dtype=d.dtype, device=d.device),
            ]
        )
        return loss, stats

    @staticmethod
    def summarize(stats: list[float]) -> dict[str, float]:
        return summarize(stats)


def summarize(stats: list[float]) -> dict[str, float]:
    """Metrics-line values (TRL's names) from a step's STATS_LEN sums over micro-steps and ranks: a side's
    means only when the step held examples of it, the margin only when it held both (as TRL logs them)."""
    s = dict(zip(_SUMS, stats, strict=True))
    out = {"kl": s["kl"] / (s["steps"] or 1.0)}
    for side in ("chosen", "rejected"):
        if s[side] > 0:
            out[f"rewards/{side}"] = s[f"rewards/{side}"] / s[side]
            out[f"logps/{side}"] = s[f"logps/{side}"] / s[side]
    if s["chosen"] > 0 and s["rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
