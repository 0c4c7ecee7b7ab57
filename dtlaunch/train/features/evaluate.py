"""Validation loss: forward only, on a loader of its own, in every layout.

The training stream is untouched: the validation loader has its own position (reset to 0 before each
evaluation, so every evaluation sees the same samples and the curve is comparable), and nothing here
draws from a random generator, so a run with evaluation resumes bit-identically. The samples are the
first `eval_batches` global batches of the validation set, split over data-parallel ranks exactly like
training batches: the mean over them is the same whatever the layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlaunch.train.data import IGNORE_INDEX
from dtlaunch.train.parallel.parallelize import compute_context
from dtlaunch.train.runtime import Runtime


@torch.no_grad()
def evaluate(rt: Runtime, val_loader: Any, batches: int) -> dict[str, float]:
    """{"val_loss", "val_ppl"}: the mean loss over every target of `batches` global batches (one host sync).
    Pipeline parallel (refused with masked data by validation) computes micro-batch means."""
    val_loader.consumed = 0
    # [summed target loss, targets]: masked (chat) data has a different number of targets per micro-batch.
    total = torch.zeros(2, device=rt.device, dtype=torch.float64)
    for _ in range(batches * rt.accum):
        batch = val_loader.next_batch()
        inputs, targets = (t.to(rt.device) for t in (batch.inputs, batch.targets))
        count = (targets != IGNORE_INDEX).sum().double()
        # nan_to_num: a micro-batch without targets has a 0/0 mean and adds nothing.
        extra = batch.model_inputs(rt.device)
        total += torch.stack([_forward_loss(rt, inputs, targets, extra).double().nan_to_num() * count, count])
    if dist.is_initialized() and dist.get_world_size() > 1:
        # TP and PP peers hold equal copies of their replica's sums; they cancel in the ratio.
        dist.all_reduce(total)
    loss = float(total[0] / total[1].clamp(min=1))
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def _forward_loss(rt: Runtime, inputs: torch.Tensor, targets: torch.Tensor, extra: dict) -> torch.Tensor:
    if rt.pipeline is not None:
        return _pipeline_loss(rt, inputs, targets)
    (model,) = rt.model_parts
    with rt.loss_context():
        with compute_context(rt.model_parts, rt.cfg, rt.device):
            loss = rt.loss_fn(rt.loss_fn.model_output(model, inputs, **extra), targets)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _pipeline_loss(rt: Runtime, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipeline's forward-only pass (the schedule's eval), mean loss on every PP rank."""
    plan = rt.pipeline
    losses: list[torch.Tensor] = []
    args = (inputs,) if plan.has_first_stage else ()
    with rt.loss_context(), compute_context(rt.model_parts, rt.cfg, rt.device):
        plan.schedule.eval(*args, **plan.step_kwargs(rt.pipeline_loss, targets, losses))
    if plan.has_last_stage:
        scale = rt.pipeline_loss.scale
        loss = torch.stack([_plain(v.detach()) for v in losses]).sum() / (scale * len(losses))
    else:
        loss = torch.zeros((), device=inputs.device)
    dist.all_reduce(loss, group=rt.pp_mesh.get_group())
    return loss


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
