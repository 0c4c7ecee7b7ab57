"""GRPO and its TRL variants (loss_type grpo / dr_grpo / dapo / bnpo / cispo, GSPO's sequence-level ratio),
as TRL 1.16 computes them (trl/trainer/grpo_trainer.py: the advantages in _generate_and_score_completions,
the loss in _compute_loss), and GRPOObjective (at the end): what the step calls, the micro-batch's loss on
the rows of the rollout (dtlaunch.train.objectives.rollout) that ran before the step.

Everything here works on (rows, seq) tensors aligned with the micro-batch's targets: `mask` is 1 on the
completion tokens that count (targets != -100; a truncated completion's are 0 under
mask_truncated_completions), `logps` the policy's per-token log-probs of those targets.

Scaling across micro-steps and data-parallel ranks: the loop sums micro-step losses, each divided by
accum (dtlaunch.train.step.micro_step), and the gradient average over dp ranks divides by dp. grpo / bnpo /
dr_grpo are per-micro-batch means (TRL divides them by its gradient-accumulation steps the same way);
dapo / cispo divide the micro-batch's token sum by the optimizer step's completion tokens over all ranks /
dp (TRL's num_items_in_batch / processes), which GRPOObjective (below) multiplies by accum before its step_loss divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from dtlaunch.train.data import IGNORE_INDEX as IGNORE
from dtlaunch.train.loss import cross_entropy

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig, ObjectiveConfig
    from dtlaunch.train.batch import MicroBatch, RolloutRows

ADV_EPS = 1e-4  # TRL: (r - mean) / (std + 1e-4)


def _nanstd(t: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaN (NaN with fewer than two values), as trl.trainer.utils.nanstd."""
    mean = torch.nanmean(t, dim=dim, keepdim=True)
    var = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(t)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def combine_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards (NaN: the function did not apply) -> (N,) weighted sums; NaN where none applied."""
    rewards = (per_func * weights[None, :]).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """TRL's sum_then_normalize advantages of the whole generation batch: (N, F) -> (N,), consecutive rows of
    `group` completions sharing a prompt. An unscorable completion (no function applied) gets 0."""
    rewards = combine_rewards(per_func, weights)
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + ADV_EPS)
    return torch.nan_to_num(adv, nan=0.0)


def importance_sampling_ratio(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float, clip_max: float
) -> torch.Tensor:
    """TRL's correction for a sampler whose numerics differ from training's (its vLLM importance sampling):
    exp(old-policy log-prob - sampler's) per token (rows, seq), or per completion (rows, 1) in the sequence_*
    modes (the tokens' differences summed), clipped to [clip_min, clip_max] (*_truncate) or zeroed outside it
    (*_mask). A token without the sampler's log-prob (NaN: replayed completions) has a difference of 0.
    clip_min 0 is no lower bound."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = clip_min if clip_min > 0 else None
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=clip_max)
    outside = ratio > clip_max
    if lo is not None:
        outside = outside | (ratio < lo)
    return ratio.masked_fill(outside, 0.0)


@dataclass(frozen=True)
class GRPOSettings:
    """objective.* of objective=grpo, read once."""

    loss_type: str
    importance_level: str
    epsilon: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    temperature: float = 1.0  # the sampler's: every log-prob of the loss is of the logits / temperature (TRL)

    @classmethod
    def of(cls, o: ObjectiveConfig) -> GRPOSettings:
        return cls(
            loss_type=str(o.loss_type),
            importance_level=str(o.importance_sampling_level),
            epsilon=float(o.epsilon),
            epsilon_high=float(o.epsilon_high),
            beta=float(o.beta),
            max_completion_length=int(o.max_completion_length),
            temperature=float(o.temperature),
        )


@dataclass
class LossParts:
    loss: torch.Tensor  # this micro-batch's share of the step's loss (see the module's note on scaling)
    per_token: torch.Tensor  # (rows, seq) per-token loss, detached
    low_clipped: torch.Tensor  # (rows, seq | 1) bool: ratio clipped below (advantage < 0), detached
    high_clipped: torch.Tensor  # ... above (advantage > 0)
    kl: Optional[torch.Tensor]  # (rows, seq) per-token KL to the reference (beta > 0), detached


def grpo_loss(
    s: GRPOSettings,
    logps: torch.Tensor,
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    adv: torch.Tensor,
    mask: torch.Tensor,
    accum: int = 1,
    step_tokens_per_rank: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
) -> LossParts:
    """The loss of one micro-batch. `old_logps` None: the rollout's policy is the current one (num_iterations
    1), the ratio is exactly 1 with its gradient. `step_tokens_per_rank` (dapo / cispo): the optimizer step's
    completion tokens over every rank, divided by dp. `is_ratio`: the sampler correction's weights
    (importance_sampling_ratio), applied before the KL term as TRL's _compute_loss does."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if s.importance_level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    a = adv.unsqueeze(1)
    if s.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=s.epsilon_high).detach() * a * logps
        low = torch.zeros_like(coef_1, dtype=torch.bool)
        high = (coef_1 > s.epsilon_high) & (a > 0)
    else:
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon, 1 + s.epsilon_high)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
        low = (coef_1 < 1 - s.epsilon) & (a < 0)
        high = (coef_1 > 1 + s.epsilon_high) & (a > 0)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    kl = None
    if s.beta != 0.0:
        assert ref_logps is not None
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        # TRL's use_bias_correction_kl (its default): the KL weighted by the importance ratio, so its gradient
        # is the unbiased reverse-KL gradient (DeepSeek-V3.2).
        per_token = per_token + s.beta * (kl * coef_1)
    masked = per_token * mask
    if s.loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
    elif s.loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / accum
    elif s.loss_type == "dr_grpo":
        loss = masked.sum() / (per_token.size(0) * s.max_completion_length) / accum
    elif s.loss_type in ("dapo", "cispo"):
        assert step_tokens_per_rank is not None
        loss = masked.sum() / step_tokens_per_rank.clamp(min=1.0)
    else:
        raise ValueError(f"unknown GRPO loss type {s.loss_type!r}")
    return LossParts(
        loss=loss,
        per_token=per_token.detach(),
        low_clipped=low.detach(),
        high_clipped=high.detach(),
        kl=kl.detach() if kl is not None else None,
    )


def token_logps(
    output: torch.Tensor, targets: torch.Tensor, token_nll: Any = None, temperature: float = 1.0
) -> torch.Tensor:
    """(rows, seq) log-probs of the targets (0 where the target is -100), from logits or through the chunked
    head (`token_nll`, as the preference objectives' completion_logps), of the distribution the rollout
    sampled from: logits / temperature, as TRL's _get_per_token_logps_and_entropies (policy, old policy and
    reference alike). The chunked head's output is the hidden states: dividing them divides the logits (its
    head has no bias, dtlaunch.train.loss.head_loss)."""
    rows, seq = targets.shape
    if temperature > 0 and temperature != 1.0:  # 0: greedy sampling, whose logits TRL leaves as they are
        output = output / temperature
    nll = token_nll(output, targets) if token_nll is not None else cross_entropy(output, targets, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.to_local()
    return -nll.view(rows, seq).float()


# The policy's entropy is measured where the logits exist whatever training.loss_chunks says: on the
# completion tokens as they are sampled (dtlaunch.infer.batch_generate, the rollout's "entropy").
STAT_NAMES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "kl")


@dataclass
class GRPOObjective:
    """objective=grpo in the step: the micro-batch's loss from the policy's output and the rollout's rows
    (MicroBatch.rollout: advantages, old / reference log-probs, the step's token count)."""

    settings: GRPOSettings
    accum: int
    # The prompts and the rollout before each step (dtlaunch.train.objectives.rollout.rollout_data, handed in by
    # build_objective: the rollout and the reference import this module's formulas, so this module imports
    # neither them nor the step data they build).
    data: Optional[Callable[..., Any]] = None  # -> step_data.StepData
    stats_len: int = len(STAT_NAMES) + 1  # the sums, then the number of loss tokens

    name = "grpo"
    needs_reference = False

    @classmethod
    def of(cls, cfg: JobConfig, accum: int, data: Optional[Callable[..., Any]] = None) -> GRPOObjective:
        return cls(GRPOSettings.of(cfg.objective), accum, data)

    def step_data(self, cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> Any:
        """Prompts, and the rollout that turns them into each step's rows (generation, rewards, advantages)."""
        assert self.data is not None, "built without its rollout (build_objective hands it in)"
        return self.data(cfg, run_dir, rt, dp_rank, dp_size)

    def step_loss(
        self, output: torch.Tensor, targets: torch.Tensor, batch: MicroBatch, ref: Any, loss_fn: Any, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's call (dtlaunch.train.objectives.Objective): the rollout's rows ride on the batch (their
        reference log-probs among them: no reference runs beside the step)."""
        assert batch.rollout is not None, "objective=grpo trains on its rollout's batches"
        loss, stats = self(output, targets, batch.rollout, loss_fn.token_nll)
        return loss / accum, stats

    def __call__(
        self, output: torch.Tensor, targets: torch.Tensor, rows: RolloutRows, token_nll: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (targets != IGNORE).float()
        logps = token_logps(output, targets, token_nll, self.settings.temperature)
        # step_loss divides every loss by accum, as every objective's does: the mean types hand it their
        # micro-batch mean; dapo / cispo, already their share of the step, are scaled back up.
        parts = grpo_loss(self.settings, logps, rows.old, rows.ref, rows.adv, mask, 1, rows.step_tokens, rows.is_ratio)
        loss = parts.loss * self.accum if self.settings.loss_type in ("dapo", "cispo") else parts.loss
        with torch.no_grad():
            tokens = mask.sum()
            full = torch.broadcast_to(mask, parts.per_token.shape)
            low = (parts.low_clipped.float().expand_as(full) * full).sum()
            high = (parts.high_clipped.float().expand_as(full) * full).sum()
            kl = (parts.kl * full).sum() if parts.kl is not None else torch.zeros((), device=tokens.device)
            stats = torch.stack([low, high, kl, tokens])
        return loss, stats

    def summarize(self, stats: list[float]) -> dict[str, float]:
        tokens = stats[-1] or 1.0
        values = {name: value / tokens for name, value in zip(STAT_NAMES, stats[:-1], strict=True)}
        if self.settings.beta == 0:  # no reference, no KL term
            del values["kl"]
        return values
