"""SimPO (Meng et al., 2024) as TRL's CPOTrainer(loss_type="simpo", cpo_alpha=0) computes it: the margin of
length-averaged log-probs less a target gap γ, -log σ(β Δavg - γ); no reference model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def simpo_losses(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward) from per-token average log-probs."""
    logits = (chosen_avg - rejected_avg) - gamma / beta
    return -F.logsigmoid(beta * logits), beta * chosen_avg.detach(), beta * rejected_avg.detach()
