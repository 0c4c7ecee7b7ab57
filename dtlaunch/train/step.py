"""One optimizer step: accumulate gradients over micro-steps, clip, step (or skip a non-finite step).

Loss scaling for parity with one big batch: each micro-step's loss is its token mean divided by the
number of accumulation micro-steps, so gradients summed over micro-steps (and averaged over data-parallel
ranks by DDP/FSDP) equal those of the mean over the whole global batch. Under PP the schedule runs the
micro-step and the pipeline loss carries the same scaling (dtlaunch.train.pp_step).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtlaunch.train.parallelize import compute_context, grad_sync
from dtlaunch.train.pp_step import clip_grad_norm, pp_forward_backward
from dtlaunch.train.tensor_parallel import cross_entropy


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool


@dataclass
class StepContext:
    """What stays the same from step to step."""

    cfg: Any
    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    loader: Any
    device: torch.device
    accum: int
    loss_context: Callable[[], Any] = contextlib.nullcontext
    pipeline: Optional[Any] = None  # dtlaunch.train.pipeline.PipelinePlan
    pipeline_loss: Optional[Any] = None  # dtlaunch.train.pp_step.PipelineLoss
    pp_mesh: Optional[Any] = None
    scaler: Optional[Any] = None
    # Called between accumulation micro-steps (the CPU memory tracker resets its per-module statistics).
    between_micro_steps: Callable[[], None] = lambda: None


def train_step(ctx: StepContext, step: int) -> StepResult:
    """Forward/backward over `accum` micro-steps (gradient sync on the last only), then clip and step."""
    poison = step in set(ctx.cfg.debug.nan_at_steps)  # test hook: a NaN loss must be skipped, not applied
    local_loss = torch.zeros((), device=ctx.device)
    for micro in range(ctx.accum):
        if micro:
            ctx.between_micro_steps()
        inputs, targets = (t.to(ctx.device) for t in ctx.loader.next_batch())
        with grad_sync(ctx.model_parts, enabled=micro == ctx.accum - 1):
            local_loss += _micro_step(ctx, inputs, targets, poison)
    loss = _dp_mean(local_loss)
    if ctx.scaler is not None:
        for opt in ctx.optimizers:
            ctx.scaler.unscale_(opt)
    params = [list(m.parameters()) for m in ctx.model_parts]
    grad_norm = float(clip_grad_norm(params, float(ctx.cfg.training.grad_clip), ctx.pp_mesh))
    # With fp16 loss scaling an overflowing step is routine: the scaler skips it and lowers the scale.
    skipped = not math.isfinite(loss) or (ctx.scaler is None and not math.isfinite(grad_norm))
    if not skipped:
        for opt in ctx.optimizers:
            ctx.scaler.step(opt) if ctx.scaler is not None else opt.step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    for opt in ctx.optimizers:
        opt.zero_grad(set_to_none=True)
    for sched in ctx.schedulers:
        sched.step()
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped)


def _micro_step(ctx: StepContext, inputs: torch.Tensor, targets: torch.Tensor, poison: bool) -> torch.Tensor:
    """One micro-step's forward + backward; returns its loss already divided by `accum`."""
    nan = float("nan") if poison else 1.0
    if ctx.pipeline is not None:
        with compute_context(ctx.model_parts, ctx.cfg, ctx.device):
            loss = pp_forward_backward(
                ctx.pipeline, ctx.pipeline_loss, inputs, targets, ctx.pp_mesh, ctx.loss_context()
            )
        if poison:
            for m in ctx.model_parts:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.mul_(nan)
        return loss.detach() * nan / ctx.accum
    (model,) = ctx.model_parts
    with ctx.loss_context():
        with compute_context(ctx.model_parts, ctx.cfg, ctx.device):
            logits = model(inputs)
        loss = cross_entropy(logits, targets) * nan / ctx.accum
        (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
    loss = loss.detach()
    # Under loss_parallel the loss is a replicated DTensor: every TP rank holds the full value.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _dp_mean(local_loss: torch.Tensor) -> float:
    """Mean over data-parallel ranks with one all-reduce over the world: TP and PP peers hold equal
    copies of their replica's loss, so the world mean is the data-parallel mean."""
    t = local_loss.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)
