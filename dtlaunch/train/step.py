"""One optimizer step: accumulate gradients over micro-steps, clip, step (or skip a non-finite step).

Loss scaling for parity with one big batch: each micro-step's loss is its token mean divided by the
number of accumulation micro-steps, so gradients summed over micro-steps (and averaged over data-parallel
ranks by DDP/FSDP) equal those of the mean over the whole global batch. Under PP the schedule runs the
micro-step and the pipeline loss carries the same scaling (dtlaunch.train.parallel.pp_step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch.distributed.tensor import DTensor

from dtlaunch.config.layout import pp_microbatches
from dtlaunch.train.objectives.pipeline import pipeline_batch
from dtlaunch.train.optim import step_unless_nonfinite
from dtlaunch.train.parallel.parallelize import compute_context, grad_sync
from dtlaunch.train.parallel.pp_step import clip_grad_norm, pp_forward_backward
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
    # Mixture of experts: this rank's router statistics (dtlaunch.train.moe_stats), still on the device.
    router_stats: Optional[torch.Tensor] = None
    # Preference objectives and GRPO: this rank's summed statistics (dtlaunch.train.objectives), on the device.
    pair_stats: Optional[torch.Tensor] = None


class Batches(Protocol):
    """Where a step's micro-batches come from: the worker's TokenLoader, seeded batches in tests, random
    tokens in the planner's trace. A loader may also expose `last_weight` (masked data) and
    `last_model_args` (document masks) for the batch it just returned."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...


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
        inputs, targets = (to_device(t, rt.device) for t in batches.next_batch())
        with grad_sync(rt.model_parts, enabled=micro == rt.accum - 1):
            local_loss += micro_step(rt, batches, inputs, targets, pair_stats)
    if rt.scaler is not None:
        for opt in rt.optimizers:
            rt.scaler.unscale_(opt)
    # The global norm decides whether the update is applied. A non-finite loss on any rank makes every
    # gradient, and so this all-reduced norm, non-finite on every rank.
    if rt.in_backward is not None:
        grad_norm = rt.in_backward.grad_norm(rt.device)
        applied: Any = True  # every parameter was updated inside backward (dtlaunch.train.optim_in_backward)
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
    before queueing this one's."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def micro_step(
    rt: Runtime,
    batches: Batches,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    pair_stats: Optional[list] = None,
) -> torch.Tensor:
    """One micro-step's forward + backward; returns its loss already divided by `accum`. A preference
    objective appends its pair statistics to `pair_stats`."""
    if rt.pipeline is not None:
        if rt.objective is not None:  # pairs kept whole in each pipeline micro-batch, the reference in the targets
            inputs, targets = pipeline_batch(rt, batches, inputs, targets)
        with compute_context(rt.model_parts, rt.cfg, rt.device):
            loss = pp_forward_backward(rt.pipeline, rt.pipeline_loss, inputs, targets, rt.pp_mesh, rt.loss_context())
        if rt.objective is not None and pair_stats is not None:
            n = pp_microbatches(rt.cfg, rt.layout) if rt.pipeline.has_last_stage else 0
            pair_stats.append(rt.pipeline_loss.take_stats(n, rt.device))
        return loss.detach() / rt.accum
    (model,) = rt.model_parts
    weight = getattr(batches, "last_weight", None)  # masked (chat) data: see TokenLoader.next_batch
    with rt.loss_context():
        extra = {k: v.to(rt.device) for k, v in getattr(batches, "last_model_args", {}).items()}
        # The loss inside the compute context too: a chunked loss (training.loss_chunks) runs the head.
        with compute_context(rt.model_parts, rt.cfg, rt.device):
            # DPO's reference first (no grad): none of its activations live through the policy's forward.
            # objective=grpo reads its rollout's rows instead (advantages, old / reference log-probs).
            ref = rt.reference(inputs, targets, batches) if rt.reference is not None else None
            if ref is None:
                ref = getattr(batches, "last_rows", None)
            out = model(inputs, **extra)
            if rt.objective is not None:
                # Preference objectives read token log-probs off the full logits (config.layout.loss_chunks).
                loss, stats = rt.objective(out, targets, ref, rt.loss_fn.token_nll)
                loss = loss / rt.accum
                if pair_stats is not None:
                    pair_stats.append(stats)
            elif weight is None:
                loss = rt.loss_fn(out, targets) / rt.accum
            else:
                loss = rt.loss_fn(out, targets, reduction="sum") * (weight / rt.accum)
        (rt.scaler.scale(loss) if rt.scaler is not None else loss).backward()
    loss = loss.detach()
    # Under loss_parallel the loss is a replicated DTensor: every TP rank holds the full value.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
