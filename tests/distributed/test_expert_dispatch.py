"""Expert-parallel dispatch/combine over gloo equals one process computing every rank's tokens.

`_worker` (below) runs on torchrun's ranks, forked from pytest (forked_ranks.run_ranks). Each rank routes a
different number of tokens (uneven all-to-all splits); the last rank's experts receive none at all, and, as
GroupedExperts does, compute an empty output that does not depend on the (empty) rows it received: its
backward must still take part in the dispatch's backward all-to-all, or its peers wait forever. The experts
are a per-expert matmul + tanh. The reference runs every rank's tokens through the full expert set in one
process with autograd: outputs, input gradients and the local experts' weight gradients must match.
"""

from __future__ import annotations

import pytest
from forked_ranks import run_ranks

EXPERTS, DIM = 6, 8


def _rank_tokens(rank: int, world: int):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    n = 5 + 4 * rank
    x = torch.randn(n, DIM, generator=gen)
    expert = torch.randint(0, EXPERTS - EXPERTS // world, (n,), generator=gen)  # the last rank's experts get none
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=EXPERTS)
    return x[order], expert[order], counts, torch.randn(n, DIM, generator=gen)


def _experts(x, weights, counts):
    import torch

    outs = [
        torch.tanh(chunk @ w) for chunk, w in zip(torch.split(x, counts.tolist()), weights, strict=True) if len(chunk)
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, DIM) + 0 * weights.sum()


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from dtlaunch.train.parallel.expert_dispatch import combine, dispatch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    weights = torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(7))
    local = EXPERTS // world

    # Reference: one process, all ranks' tokens, the full expert set.
    ref_w = weights.clone().requires_grad_()
    data = [_rank_tokens(r, world) for r in range(world)]
    ref_x = [x.clone().requires_grad_() for x, *_ in data]
    ref_y = [_experts(x, ref_w, c) for x, (_, _, c, _) in zip(ref_x, data, strict=True)]
    sum((y * g).sum() for y, (*_, g) in zip(ref_y, data, strict=True)).backward()

    x, _, counts, g = data[rank]
    x = x.clone().requires_grad_()
    w = weights[rank * local : (rank + 1) * local].clone().requires_grad_()
    rows, local_counts, plan = dispatch(x, counts, dist.group.WORLD)
    want_counts = sum(c for _, _, c, _ in data)[rank * local : (rank + 1) * local]
    assert torch.equal(local_counts, want_counts), (local_counts, want_counts)
    y = combine(_experts(rows, w, local_counts), plan, dist.group.WORLD)
    (y * g).sum().backward()
    torch.testing.assert_close(y, ref_y[rank].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x[rank].grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w.grad[rank * local : (rank + 1) * local], rtol=0, atol=1e-5)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_dispatch_combine_match_one_process(world: int) -> None:
    """2 ranks x 3 experts each: uneven splits in both directions, a rank that receives no token."""
    proc = run_ranks(world, _worker, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:]
