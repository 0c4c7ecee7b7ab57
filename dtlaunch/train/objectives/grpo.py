"""GRPO and its TRL variants (loss_type grpo / dr_grpo / dapo / bnpo / cispo, GSPO's sequence-level ratio),
as TRL 1.16 computes them (trl/trainer/grpo_trainer.py: the advantages in _generate_and_score_completions,
the loss in _compute_loss).

Everything here works on (rows, seq) tensors aligned with the micro-batch's targets: `mask` is 1 on the
completion tokens that count (targets != -100; a truncated completion's are 0 under
mask_truncated_completions), `logps` the policy's per-token log-probs of those targets.

Scaling across micro-steps and data-parallel ranks: the loop sums micro-step losses, each divided by
accum (dtlaunch.train.step.micro_step), and the gradient average over dp ranks divides by dp. grpo / bnpo /
dr_grpo are per-micro-batch means (TRL divides them by its gradient-accumulation steps the same way);
dapo / cispo divide the micro-batch's token sum by the optimizer step's completion tokens over all ranks /
dp (TRL's num_items_in_batch / processes), which GRPOObjective (dtlaunch.train.objectives.rollout) multiplies by accum before the step divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.tensor import DTensor

from dtlaunch.train.loss import cross_entropy

if TYPE_CHECKING:
    from dtlaunch.config.schema import ObjectiveConfig

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
