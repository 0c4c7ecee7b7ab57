"""One optimizer step: accumulate gradients over micro-steps, clip, step (or skip a non-finite step).

Loss scaling for parity with one big batch: each micro-step's loss is its token mean divided by the
number of accumulation micro-steps, so gradients summed over micro-steps (and averaged over data-parallel
ranks by DDP/FSDP) equal those of the mean over the whole global batch. Under PP the schedule runs the
micro-step (dtlaunch.train.parallel.pipeline) and the pipeline loss carries the same scaling
(dtlaunch.train.loss). The loss itself, in every form, is dtlaunch.train.loss; the loop around the step
is dtlaunch.train.trainer.

Read top to bottom: `train_step` (micro-steps, then the update), `micro_step` (one forward + backward),
`grad_sync` (when data-parallel gradients are reduced), `clip_grad_norm` (the global norm over any layout).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dtlaunch.train.batch import MicroBatch
from dtlaunch.train.optim import step_unless_nonfinite
from dtlaunch.train.parallel.parallelize import compute_context, uses_fsdp
from dtlaunch.train.runtime import Runtime


@dataclass
class StepResult:
    # This rank's loss (micro-step means / accum, summed), still on the device: the loop's WindowSync
    # averages it over ranks.
    local_loss: torch.Tensor
    grad_norm: torch.Tensor  # fp32 scalar, equal on every rank, not yet read by the host
    # False when the optimizer step was not applied (non-finite gradient norm, no loss scaler). A device
    # tensor when the optimizer skips on the device (no host sync; see dtlaunch.train.optim).
    applied: Any
    # Mixture of experts: this rank's router statistics (dtlaunch.train.features.moe_stats), still on the device.
    router_stats: Optional[torch.Tensor] = None
    # The objective's summed statistics on this rank (dtlaunch.train.objectives; None for sft), on the device.
    pair_stats: Optional[torch.Tensor] = None


class Batches(Protocol):
    """Where a step's micro-batches come from: the worker's TokenLoader, a GRPO rollout, seeded batches in
    tests, random tokens in the planner's trace. Each batch carries its own per-row values (MicroBatch)."""

    def next_batch(self) -> MicroBatch: ...


def train_step(
    rt: Runtime,
    batches: Batches,
    step: int,
    *,
    micro_steps: Optional[Sequence[int]] = None,
    host_reads: bool = True,
    before_micro: Optional[Callable[[int], None]] = None,
) -> StepResult:
    """Forward/backward over the runtime's `accum` micro-steps (gradient sync on the last only), then
    clip, step the optimizers, update the loss scale, the float8 scales, the LR schedules and an MoE
    model's router balance.

    For the planner's trace: `micro_steps` runs only those of the accumulation micro-steps (each still
    divided by accum), `host_reads=False` applies the update without reading the gradient norm on the
    host (fake tensors have no values), `before_micro(n)` runs before the n-th micro-step run."""
    local_loss = torch.zeros((), device=rt.device)
    pair_stats: list[torch.Tensor] = []
    for n, micro in enumerate(range(rt.accum) if micro_steps is None else micro_steps):
        if before_micro is not None:
            before_micro(n)
        batch = batches.next_batch()
        inputs, targets = (to_device(t, rt.device) for t in (batch.inputs, batch.targets))
        with grad_sync(rt.model_parts, enabled=micro == rt.accum - 1):
            local_loss += micro_step(rt, batch, inputs, targets, pair_stats)
    if rt.scaler is not None:
        for opt in rt.optimizers:
            rt.scaler.unscale_(opt)
    # The global norm decides whether the update is applied. A non-finite loss on any rank makes every
    # gradient, and so this all-reduced norm, non-finite on every rank.
    if rt.in_backward is not None:
        grad_norm = rt.in_backward.grad_norm(rt.device)
        applied: Any = True  # every parameter was updated inside backward (dtlaunch.train.features.optim_in_backward)
    else:
        grad_norm = clip_grad_norm(rt.params, rt.grad_clip, rt.pp_mesh)
        if rt.scaler is not None:
            # With fp16 loss scaling an overflowing step is routine: the scaler skips it and lowers the scale.
            applied = True
            for opt in rt.optimizers:
                rt.scaler.step(opt)
        elif rt.skip_on_device:
            # Fused AdamW skips a non-finite step inside its kernel: the host never waits for the norm.
            applied = torch.isfinite(grad_norm)
            for opt in rt.optimizers:
                step_unless_nonfinite(opt, grad_norm)
        else:
            # Host decision (free on CPU, where there is no queue of kernels to stall).
            applied = math.isfinite(float(grad_norm)) if host_reads else True
            if applied:
                for opt in rt.optimizers:
                    opt.step()
    if rt.scaler is not None:
        rt.scaler.update()
    if rt.float8_scales is not None:
        rt.float8_scales()
    for opt in rt.optimizers:
        opt.zero_grad(set_to_none=True)
    for sched in rt.schedulers:
        sched.step()
    stats = rt.moe.after_step(rt.model_parts) if rt.moe is not None else None
    pairs = torch.stack(pair_stats).sum(0) if pair_stats else None
    return StepResult(local_loss=local_loss, grad_norm=grad_norm, applied=applied, router_stats=stats, pair_stats=pairs)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on the device. To a GPU through pinned memory without blocking: a plain `.to()` from
    pageable memory synchronises the stream, so the host would wait for the previous step's kernels
    before queueing this one's. Rows already on the device (a GRPO rollout's, generated there) stay as they
    are: only a host tensor can be pinned."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def micro_step(
    rt: Runtime,
    batch: MicroBatch,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    pair_stats: Optional[list] = None,
) -> torch.Tensor:
    """One micro-step's forward + backward of `batch` (`inputs`, `targets`: its rows on the device); returns
    its loss already divided by `accum`. The job's objective (dtlaunch.train.objectives) computes the loss
    from the model's output and appends its statistics, if it has any, to `pair_stats`."""
    objective = rt.objective
    if rt.pipeline is not None:
        inputs, targets = objective.pipeline_rows(rt, batch, inputs, targets)
        with compute_context(rt.model_parts, rt.cfg, rt.device):
            loss = rt.pipeline.forward_backward(rt.pipeline_loss, inputs, targets, rt.pp_mesh, rt.loss_context())
        if objective.stats_len and pair_stats is not None:
            n = rt.decisions.pp_microbatches if rt.pipeline.has_last_stage else 0
            pair_stats.append(rt.pipeline_loss.take_stats(n, rt.device))
        return loss.detach() / rt.accum
    (model,) = rt.model_parts
    with rt.loss_context():
        extra = batch.model_inputs(rt.device)
        # The loss inside the compute context too: a chunked loss (training.loss_chunks) runs the head.
        with compute_context(rt.model_parts, rt.cfg, rt.device):
            # DPO's reference first (no grad): none of its activations live through the policy's forward.
            # (A precomputed reference reads its values off the batch: dtlaunch.train.objectives.reference.)
            ref = rt.reference(inputs, targets, batch) if rt.reference is not None else None
            out = rt.loss_fn.model_output(model, inputs, **extra)
            loss, stats = objective.step_loss(out, targets, batch, ref, rt.loss_fn, rt.accum)
            if stats is not None and pair_stats is not None:
                pair_stats.append(stats)
        (rt.scaler.scale(loss) if rt.scaler is not None else loss).backward()
    loss = loss.detach()
    # Under loss_parallel the loss is a replicated DTensor: every TP rank holds the full value.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def grad_sync(model_parts: Iterable[nn.Module], enabled: bool) -> Any:
    """DDP skips its all-reduce on non-final accumulation micro-steps (gradients just add up locally).

    FSDP (ZeRO-2/3) reduce-scatters on every micro-step instead: skipping it would keep the full,
    unsharded gradients (4 bytes/param) alive between micro-steps, undoing the memory ZeRO saves."""
    stack = contextlib.ExitStack()
    for m in model_parts:
        if not enabled and not uses_fsdp(m) and hasattr(m, "no_sync"):
            stack.enter_context(m.no_sync())
    return stack


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
        # No detach: this runs under no_grad (clip_grad_norm) on gradients, which carry no graph; a detach
        # per parameter was an aten op each, every step.
        locals_by_key.setdefault(key, []).append(g)
    groups = {key: _sum_of_squares(ts) for key, ts in locals_by_key.items()}
    total = None  # no host-side zero: copying it to a GPU would synchronise the stream every step
    for key, sq in groups.items():
        if key:
            mesh, dims = key
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
        total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros(())


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
