"""Token dispatch and combine for expert parallel: all-to-all of token counts, then of the tokens.

Each EP rank holds `E / ep` consecutive experts. The MoE layer hands its experts module the token
copies already grouped by (global) expert, with a count per expert. Dispatch:
  1. all-to-all of the counts: rank r learns how many tokens every peer sends to each of r's experts;
  2. all-to-all of the tokens (uneven splits: rank-major, expert order inside each rank's block);
  3. a permutation regroups the received rows expert-major, which is what grouped experts compute on.
Combine undoes 3 and sends the rows back with the reverse all-to-all, so the layer scatters them into
its tokens exactly as without EP. Both all-to-alls on tokens carry gradients (their backward is the
all-to-all with the splits swapped); the counts need none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Rows of `x` (dim 0) split by `in_splits` to the ranks of `group`; rows received by `out_splits`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class DispatchPlan:
    """What combine needs to send the expert outputs back: the splits of dispatch and its regrouping."""

    in_splits: list[int]  # rows this rank sent to each peer
    out_splits: list[int]  # rows this rank received from each peer
    inverse: torch.Tensor  # expert-major row -> rank-major row
    # A zero that depends on the received rows: see `combine`.
    anchor: torch.Tensor | None = None


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send each token copy to the rank holding its expert.

    x: [T, dim] grouped by global expert; counts: int64 [E] tokens per global expert (this rank's).
    Returns the rows for this rank's experts grouped expert-major, their counts [E / ep] and the plan.
    """
    ep = dist.get_world_size(group)
    counts = counts.to(torch.int64)
    received = torch.empty_like(counts)
    # received[r * local + e]: tokens peer r sends to this rank's expert e.
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    send = counts.view(ep, -1)
    recv = received.view(ep, -1)
    # One host sync for both: the uneven splits must be known on the host.
    host = torch.cat([send.sum(1), recv.sum(1)]).tolist()
    in_splits, out_splits = host[:ep], host[ep:]
    rows = all_to_all(x, out_splits, in_splits, group)
    order = _expert_major(recv, sum(out_splits))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    plan = DispatchPlan(in_splits=in_splits, out_splits=out_splits, inverse=inverse)
    if rows.shape[0] == 0 and rows.requires_grad:
        plan.anchor = rows.sum() * 0
    return rows[order], recv.sum(0), plan


def combine(y: torch.Tensor, plan: DispatchPlan, group: Any) -> torch.Tensor:
    """Expert outputs (expert-major, as dispatch returned the inputs) back to the ranks that sent them,
    in the order the tokens left: the layer's own grouped order."""
    if plan.anchor is not None:
        # This rank received no token: the experts' output does not depend on the (empty) received rows,
        # so autograd would skip the dispatch's backward all-to-all here while the peers that sent this
        # rank nothing still run theirs with it, and wait forever. The zero keeps it in the graph.
        y = y + plan.anchor
    return all_to_all(y[plan.inverse], plan.in_splits, plan.out_splits, group)


def _expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that turn the received rank-major blocks (peer r: experts 0..local-1) into
    expert-major order (expert e: peers 0..ep-1), keeping each block's internal order.

    recv: [ep, local] rows per (peer, local expert); total: their sum (known on the host already)."""
    flat = recv.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv).t().flatten()  # where each block begins
    lengths = recv.t().flatten()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=recv.device), lengths, output_size=total)
    begins = torch.cumsum(lengths, 0) - lengths  # where each block lands
    return starts[segment] + torch.arange(total, device=recv.device) - begins[segment]
