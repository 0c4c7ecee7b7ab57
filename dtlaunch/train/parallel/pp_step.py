"""One micro-step through a pipeline schedule, the pipeline loss, and grad-norm clipping over any layout.

Loss scaling under PP: the schedule sums gradients over its micro-batches (scale_grads=False), and the
worker sums them over `grad_accum` micro-steps; so each micro-batch loss is multiplied by
1 / (n_microbatches * grad_accum), which makes the accumulated gradient that of the global-batch mean,
exactly as the non-pipelined step does with 1 / grad_accum.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

if TYPE_CHECKING:  # torch.distributed.pipelining (and torch._dynamo with it) only where a pipeline runs
    from dtlaunch.train.parallel.pipeline import PipelinePlan


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss_parallel's loss) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class PipelineLoss:
    """The last stage's loss_fn: the loss times `scale` (what backward sees).

    It records nothing itself: torch also calls loss_fn on placeholder outputs while inferring
    backward metadata at the first step, so the real losses are taken from the schedule's `losses=`.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], scale: float) -> None:
        self.loss_fn = loss_fn
        self.scale = scale

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.scale


def pipeline_loss_fn(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_microbatches: int, grad_accum: int
) -> PipelineLoss:
    return PipelineLoss(loss_fn, 1.0 / (n_microbatches * grad_accum))


def pp_forward_backward(
    plan: PipelinePlan,
    loss_fn: PipelineLoss,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    pp_mesh: DeviceMesh,
    loss_ctx: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """Run forward+backward of one micro-step; return its mean loss (the same value on every PP rank).

    Every rank of a pipeline gets the same (inputs, targets); the first stage consumes the inputs, the
    last the targets. `loss_ctx` (loss_parallel under TP) must cover the schedule: the loss and its
    backward both run inside `step`.
    """
    losses: list[torch.Tensor] = []
    args = (inputs,) if plan.has_first_stage else ()
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if plan.has_last_stage else {}
    with loss_ctx if loss_ctx is not None else contextlib.nullcontext():
        plan.schedule.step(*args, return_outputs=False, **kwargs)
    if plan.has_last_stage:
        # Undo the backward scaling: the mean over the micro-batches of the unscaled loss.
        loss = torch.stack([_local(v.detach()) for v in losses]).sum() / (loss_fn.scale * len(losses))
    else:
        loss = torch.zeros((), device=inputs.device)
    # Only the last stage knows the loss; a SUM over the pipeline group hands it to every stage.
    dist.all_reduce(loss, group=pp_mesh.get_group())
    return loss


def _squared_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all gradient elements, each counted once across DP/TP shards and replicas.

    Local sums are grouped by (mesh, sharded mesh dims) and all-reduced over the sharded dims only:
    replicated dims hold copies, which must not be added twice. Plain tensors are full copies.
    Within a group the norms come from one multi-tensor kernel per (device, dtype) (what
    torch.nn.utils.get_total_norm uses): one op per gradient would cost tens of microseconds each.
    """
    locals_by_key: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key: tuple = ()
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
            # "Not replicated" rather than is_shard(): FSDP x TP uses _StridedShard, not a Shard subclass.
            dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            key = (g.device_mesh, dims) if dims else ()
            g = g.to_local()
        locals_by_key.setdefault(key, []).append(g.detach())
    groups = {key: _sum_of_squares(ts) for key, ts in locals_by_key.items()}
    total = None  # no host-side zero: copying it to a GPU would synchronise the stream every step
    for key, sq in groups.items():
        if key:
            mesh, dims = key
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
        total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros(())


@torch.no_grad()
def clip_grad_norm(
    parameters_by_part: list[Iterable[torch.nn.Parameter]], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Global L2 grad norm over every part on this rank, every DP/TP shard and every pipeline rank;
    grads are scaled in place so that the norm is at most `max_norm` (no clipping when max_norm <= 0).
    Returns the norm before clipping (a plain fp32 scalar, equal on all ranks)."""
    grads = [p.grad for part in parameters_by_part for p in part if p.grad is not None]
    sq = _squared_norm(grads)
    if pp_mesh is not None and pp_mesh.size() > 1:
        # Each pipeline rank holds different layers: their squared norms add up.
        dist.all_reduce(sq, group=pp_mesh.get_group())
    total = sq.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for (device, _), ts in _by_device_dtype(g.to_local() if isinstance(g, DTensor) else g for g in grads).items():
            torch._foreach_mul_(ts, coef.to(device))
    return total


def _by_device_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of the squares of every element, via one foreach norm per (device, dtype)."""
    parts = []
    for ts in _by_device_dtype(tensors).values():
        norms = torch._foreach_norm(ts, 2.0, dtype=torch.float32)
        parts.append(torch.stack(norms).pow(2).sum())
    total = parts[0]
    for p in parts[1:]:
        total = total + p.to(total.device)
    return total
