"""Per-sequence log-probabilities of the completion tokens: what every preference objective scores.

A preference micro-batch stacks each pair's chosen row above its rejected row as TRL does: rows 0..B-1
are the chosen completions, rows B..2B-1 the rejected ones, in the same pair order. Targets that are not
completion tokens (the prompt, padding) are -100 and contribute nothing.

Context parallel: each CP rank holds chunks of every row, so its sums are partial; they are summed over
the CP group (`SumOverRanks`) before any loss, which every CP rank then computes identically. The
backward sums the CP ranks' (identical) gradients of that loss: each rank's gradient is cp times its
share, and the gradient average over the dp_shard_cp mesh (as SFT's) divides the cp back out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlaunch.train.data import IGNORE_INDEX
from dtlaunch.train.loss import cross_entropy


@dataclass
class Completions:
    logps: torch.Tensor  # (2B,) fp32 sums of log p(y_t | y_<t, x) over completion tokens
    tokens: torch.Tensor  # (2B,) completion tokens per row

    def halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) halves of a per-row tensor."""
        return t.chunk(2, dim=0)


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over `group`; backward all-reduces (sums) the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


# The model's output and the targets -> per-token negative log-likelihoods: the chunked head and loss
# (dtlaunch.train.loss.HeadLoss with reduction="none") where the model returns hidden states.
TokenNLL = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def completion_logps(
    output: torch.Tensor, targets: torch.Tensor, cp_group: Optional[Any] = None, token_nll: Optional[TokenNLL] = None
) -> Completions:
    """Sums over completion tokens of the log-probs of (2B, S) targets (-100: not counted), from (2B, S, V)
    logits, or from the model's hidden states through `token_nll` (training.loss_chunks: the head runs
    chunk by chunk and the full logits never exist).

    Under tensor parallel the logits are vocabulary-sharded and this runs inside `loss_context`; the
    per-token values come back replicated, so every TP rank holds them whole. `cp_group`: the context-
    parallel group whose ranks hold the other chunks of these rows (None without CP)."""
    rows, seq = targets.shape
    nll = token_nll(output, targets) if token_nll is not None else cross_entropy(output, targets, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.to_local()  # replicated: the local value is the whole one (its gradient stays replicated)
    per_token = -nll.view(rows, seq)
    logps, tokens = per_token.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)
    if cp_group is not None:
        logps = SumOverRanks.apply(logps, cp_group)
        dist.all_reduce(tokens, group=cp_group)
    return Completions(logps=logps, tokens=tokens)
