"""DPO and its TRL variants (sigmoid, ipo, hinge, robust) from completion log-probs, as TRL 1.16 computes
them (trl/trainer/dpo_trainer.py): the margin is Δ = [logp(y+) - ref(y+)] - [logp(y-) - ref(y-)].

label_smoothing: only `robust` uses it, as TRL >= 0.29 (its sigmoid loss ignores it). torchtune applies it
to sigmoid as "conservative DPO", -(1-ε) log σ(βΔ) - ε log σ(-βΔ); that is not offered here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
