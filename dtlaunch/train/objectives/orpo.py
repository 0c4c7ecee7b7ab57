"""ORPO (Hong et al., 2024) as TRL's ORPOTrainer computes it: length-averaged log-probs, loss = NLL of the
chosen completion (mean over its tokens) - β log σ(log-odds ratio); no reference model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair odds-ratio term to subtract, chosen reward, rejected reward) from per-token average log-probs."""
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    return beta * F.logsigmoid(log_odds), beta * chosen_avg.detach(), beta * rejected_avg.detach()
