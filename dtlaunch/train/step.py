"""One optimizer step: accumulate gradients over micro-steps, clip, step (or skip a non-finite step).

Loss scaling for parity with one big batch: each micro-step's loss is its token mean divided by the
number of accumulation micro-steps, so gradients summed over micro-steps (and averaged over data-parallel
ranks by DDP/FSDP) equal those of the mean over the whole global batch. Under PP the schedule runs the
micro-step and the pipeline loss carries the same scaling (dtlaunch.train.parallel.pp_step).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtlaunch.train.optim import skips_on_device, step_unless_nonfinite
from dtlaunch.train.parallel.float8 import scale_precompute
from dtlaunch.train.parallel.parallelize import compute_context, grad_sync
from dtlaunch.train.parallel.pp_step import clip_grad_norm, pp_forward_backward
from dtlaunch.train.parallel.tensor_parallel import cross_entropy


@dataclass
class StepResult:
    # This rank's loss (micro-step means / accum, summed), still on the device: the loop's WindowSync
    # averages it over ranks.
    local_loss: torch.Tensor
    grad_norm: torch.Tensor  # fp32 scalar, equal on every rank, not yet read by the host
    # False when the optimizer step was not applied (non-finite gradient norm, no loss scaler). A device
    # tensor when the optimizer skips on the device (no host sync; see dtlaunch.train.optim).
    applied: Any
    # Mixture of experts: this rank's router statistics (dtlaunch.train.moe_stats), still on the device.
    router_stats: Optional[torch.Tensor] = None


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
    pipeline: Optional[Any] = None  # dtlaunch.train.parallel.pipeline.PipelinePlan
    pipeline_loss: Optional[Any] = None  # dtlaunch.train.parallel.pp_step.PipelineLoss
    pp_mesh: Optional[Any] = None
    scaler: Optional[Any] = None
    moe: Optional[Any] = None  # dtlaunch.train.moe_stats.RouterTracker for MoE models

    def __post_init__(self) -> None:
        # Read once: OmegaConf attribute access costs tens of microseconds per step.
        self.grad_clip = float(self.cfg.training.grad_clip)
        self.nan_steps = frozenset(int(s) for s in self.cfg.debug.nan_at_steps)
        self.skip_on_device = self.scaler is None and all(skips_on_device(o) for o in self.optimizers)
        # Float8 weights all-gathered by FSDP: their scales, recomputed after every optimizer step.
        self.float8_scales = scale_precompute(self.model_parts) if self.cfg.precision.float8 != "none" else None
        # The parameters whose gradients are clipped, listed once: walking the module tree costs more
        # than the norm itself on a small model. After parallelize the registered parameters are final
        # (FSDP2 registers its sharded ones, which hold the gradients, between steps).
        self.params = [list(m.parameters()) for m in self.model_parts]


def train_step(ctx: StepContext, step: int) -> StepResult:
    """Forward/backward over `accum` micro-steps (gradient sync on the last only), then clip and step."""
    poison = step in ctx.nan_steps  # test hook: a NaN loss must be skipped, not applied
    local_loss = torch.zeros((), device=ctx.device)
    for micro in range(ctx.accum):
        inputs, targets = (to_device(t, ctx.device) for t in ctx.loader.next_batch())
        with grad_sync(ctx.model_parts, enabled=micro == ctx.accum - 1):
            local_loss += _micro_step(ctx, inputs, targets, poison)
    if ctx.scaler is not None:
        for opt in ctx.optimizers:
            ctx.scaler.unscale_(opt)
    # The global norm decides whether the update is applied. A non-finite loss on any rank makes every
    # gradient, and so this all-reduced norm, non-finite on every rank.
    grad_norm = clip_grad_norm(ctx.params, ctx.grad_clip, ctx.pp_mesh)
    if ctx.scaler is not None:
        # With fp16 loss scaling an overflowing step is routine: the scaler skips it and lowers the scale.
        applied: Any = True
        for opt in ctx.optimizers:
            ctx.scaler.step(opt)
    elif ctx.skip_on_device:
        # Fused AdamW skips a non-finite step inside its kernel: the host never waits for the norm.
        applied = torch.isfinite(grad_norm)
        for opt in ctx.optimizers:
            step_unless_nonfinite(opt, grad_norm)
    else:
        # Host decision (free on CPU, where there is no queue of kernels to stall).
        applied = math.isfinite(float(grad_norm))
        if applied:
            for opt in ctx.optimizers:
                opt.step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    if ctx.float8_scales is not None:
        ctx.float8_scales()
    for opt in ctx.optimizers:
        opt.zero_grad(set_to_none=True)
    for sched in ctx.schedulers:
        sched.step()
    stats = ctx.moe.after_step(ctx.model_parts) if ctx.moe is not None else None
    return StepResult(local_loss=local_loss, grad_norm=grad_norm, applied=applied, router_stats=stats)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on the device. To a GPU through pinned memory without blocking: a plain `.to()` from
    pageable memory synchronises the stream, so the host would wait for the previous step's kernels
    before queueing this one's."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
