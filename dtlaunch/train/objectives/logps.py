"""Per-sequence log-probabilities of the completion tokens: what every preference objective scores.

A preference micro-batch stacks each pair's chosen row above its rejected row as TRL does: rows 0..B-1
are the chosen completions, rows B..2B-1 the rejected ones, in the same pair order. Targets that are not
completion tokens (the prompt, padding) are -100 and contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from dtlaunch.train.parallel.tensor_parallel import cross_entropy


@dataclass
class Completions:
    logps: torch.Tensor  # (2B,) fp32 sums of log p(y_t | y_<t, x) over completion tokens
    tokens: torch.Tensor  # (2B,) completion tokens per row

    def halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) halves of a per-row tensor."""
        return t.chunk(2, dim=0)


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> Completions:
    """Sums over completion tokens of (2B, S, V) logits' log-probs of (2B, S) targets (-100: not counted).

    Under tensor parallel the logits are vocabulary-sharded and this runs inside `loss_context`; the
    per-token values come back replicated, so every TP rank holds them whole."""
    rows, seq = targets.shape
    nll = cross_entropy(logits, targets, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.to_local()  # replicated: the local value is the whole one (its gradient stays replicated)
    per_token = -nll.view(rows, seq)
    return Completions(logps=per_token.sum(dim=1), tokens=(targets != -100).sum(dim=1))
