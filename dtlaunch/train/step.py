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
    # This rank's loss (micro-step means / accum, summed), still on the device: `end_of_step` averages it.
    local_loss: torch.Tensor
    grad_norm: float
    # False when the optimizer step was not applied (non-finite gradient norm, no loss scaler).
    applied: bool


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

    def __post_init__(self) -> None:
        # Read once: OmegaConf attribute access costs tens of microseconds per step.
        self.grad_clip = float(self.cfg.training.grad_clip)
        self.nan_steps = frozenset(int(s) for s in self.cfg.debug.nan_at_steps)


def train_step(ctx: StepContext, step: int) -> StepResult:
    """Forward/backward over `accum` micro-steps (gradient sync on the last only), then clip and step."""
    poison = step in ctx.nan_steps  # test hook: a NaN loss must be skipped, not applied
    local_loss = torch.zeros((), device=ctx.device)
    for micro in range(ctx.accum):
        inputs, targets = (t.to(ctx.device) for t in ctx.loader.next_batch())
        with grad_sync(ctx.model_parts, enabled=micro == ctx.accum - 1):
            local_loss += _micro_step(ctx, inputs, targets, poison)
    if ctx.scaler is not None:
        for opt in ctx.optimizers:
            ctx.scaler.unscale_(opt)
    params = [list(m.parameters()) for m in ctx.model_parts]
    # The one host sync of the step: the global norm decides whether the update is applied. A non-finite
    # loss on any rank makes every gradient, and so this all-reduced norm, non-finite on every rank.
    grad_norm = float(clip_grad_norm(params, ctx.grad_clip, ctx.pp_mesh))
    # With fp16 loss scaling an overflowing step is routine: the scaler skips it and lowers the scale.
    applied = ctx.scaler is not None or math.isfinite(grad_norm)
    if applied:
        for opt in ctx.optimizers:
            ctx.scaler.step(opt) if ctx.scaler is not None else opt.step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    for opt in ctx.optimizers:
        opt.zero_grad(set_to_none=True)
    for sched in ctx.schedulers:
        sched.step()
    return StepResult(local_loss=local_loss, grad_norm=grad_norm, applied=applied)


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
    weight = getattr(ctx.loader, "last_weight", None)  # masked (chat) data: see TokenLoader.next_batch
    with ctx.loss_context():
        extra = {k: v.to(ctx.device) for k, v in getattr(ctx.loader, "last_model_args", {}).items()}
        with compute_context(ctx.model_parts, ctx.cfg, ctx.device):
            logits = model(inputs, **extra)
        if weight is None:
            loss = cross_entropy(logits, targets) * nan / ctx.accum
        else:
            loss = cross_entropy(logits, targets, reduction="sum") * (weight * nan / ctx.accum)
        (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
    loss = loss.detach()
    # Under loss_parallel the loss is a replicated DTensor: every TP rank holds the full value.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def end_of_step(local_loss: torch.Tensor, signal_requested: int) -> tuple[float, int]:
    """The one extra collective per step, on every rank: the data-parallel mean loss and whether any rank
    was asked to stop (preemption), in a single SUM all-reduce of [loss, asked, signal number].

    TP and PP peers hold equal copies of their replica's loss, so the world mean is the data-parallel
    mean. The signal is recovered as the mean signal number over the ranks that got one."""
    t = torch.stack(
        [
            local_loss.detach().float().reshape(()),
            torch.tensor(float(signal_requested > 0), device=local_loss.device),
            torch.tensor(float(signal_requested), device=local_loss.device),
        ]
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(t)
    loss, asked, total = t.tolist()
    return loss / world, (round(total / asked) if asked else 0)
