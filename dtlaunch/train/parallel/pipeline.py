"""Pipeline parallel: split the model into stages, build a torch.distributed.pipelining schedule over them,
and run one micro-step through it.

Two steps to build, so that the worker can parallelise each stage module (TP -> AC -> compile -> FSDP) and
materialise it in between, torchtitan's order:

    parts = build_stage_modules(model, cfg, layout, pp_rank)     # meta-device stage modules
    for _, part in parts: parallelize(part, ...); materialise + init
    plan = build_schedule(parts, pp_mesh, cfg, dec, loss_fn, device)  # dec: config.decisions.Decisions

A stage is a deep copy of the (meta) model with the blocks it does not own deleted. `layers` is a
ModuleDict keyed by the *global* block index, so parameter names (FQNs) are those of the full model:
checkpoints and the name-keyed init are layout independent.

A micro-step (`PipelinePlan.forward_backward`): every rank of a pipeline gets the same (inputs, targets);
the first stage consumes the inputs, the last the targets, whose loss (dtlaunch.train.loss.PipelineLoss)
carries the step's scaling. Only the last stage knows the loss; it is handed to every stage.

The stage's gradient policy across micro-batches (`strategy.pp_reshard_grads`): torch's PipelineStage
turns an FSDP module's gradient sync and resharding off before every micro-batch's backward and runs both
once after the step's last backward (`perform_reduce_grad`): the stage's gradients accumulate unsharded
(and ZeRO-3 parameters stay gathered) across the micro-batches, then one reduce-scatter. That is
`pp_reshard_grads=false`, the plain PipelineStage. `pp_reshard_grads=true` keeps FSDP's own behaviour
inside every backward instead, as in a non-pipelined accumulation micro-step: each block reduce-scatters
its gradients and reshards its parameters as soon as its backward is done, into sharded gradients that
accumulate across the micro-batches (`ReshardingStage`). The end-of-step `perform_reduce_grad` then finds
nothing left to reduce.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout, pp_stage_layers
from dtlaunch.config.schema import PP_SCHEDULES
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Schedules whose two stages per rank form a "V": rank r holds stages r and (n_stages - 1 - r).
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass
class PipelinePlan:
    schedule: Any
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    stage_ids: list[int]

    def forward_backward(
        self,
        loss_fn: Any,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        pp_mesh: DeviceMesh,
        loss_ctx: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Run forward+backward of one micro-step; return its mean loss (the same value on every PP rank).

        `loss_fn` is the schedule's (a dtlaunch.train.loss.PipelineLoss: its `scale` is undone here; its
        `logits` says what the last stage's forward returns).
        `loss_ctx` (loss_parallel under TP) must cover the schedule: the loss and its backward both run
        inside `step`."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        with loss_ctx if loss_ctx is not None else contextlib.nullcontext():
            self.schedule.step(*args, return_outputs=False, **self.step_kwargs(loss_fn, targets, losses))
        if self.has_last_stage:
            # Undo the backward scaling: the mean over the micro-batches of the unscaled loss.
            loss = torch.stack([_local(v.detach()) for v in losses]).sum() / (loss_fn.scale * len(losses))
        else:
            loss = torch.zeros((), device=inputs.device)
        # Only the last stage knows the loss; a SUM over the pipeline group hands it to every stage.
        dist.all_reduce(loss, group=pp_mesh.get_group())
        return loss

    def step_kwargs(self, loss_fn: Any, targets: torch.Tensor, losses: list[torch.Tensor]) -> dict[str, Any]:
        """The schedule's keyword arguments (its `step` and `eval`) on this rank: on the last stage's, the
        targets, the list that collects the losses, and the stage's `head` argument (the logits, or the hidden
        states of a chunked loss: `loss_fn.head_kwargs`), which the schedule hands to this rank's stages unsplit."""
        if not self.has_last_stage:
            return {}
        return {"target": targets, "losses": losses, **loss_fn.head_kwargs}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss_parallel's loss) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def schedule_class(name: str) -> type:
    """`strategy.pp_schedule` -> schedule class: our short names, a class name, or torch's own names."""
    cls_name = PP_SCHEDULES.get(name, name)
    cls = getattr(schedules, cls_name, None)
    if isinstance(cls, type):
        return cls
    try:
        return schedules.get_schedule_class(name)
    except ValueError:
        raise ConfigError(
            f"strategy.pp_schedule='{name}' is not a torch.distributed.pipelining schedule: use one of "
            f"{', '.join(PP_SCHEDULES)}"
        ) from None


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule_name: str) -> list[int]:
    """Stage indices run by `pp_rank`: looped (r, r+pp, ...) or V-shaped for ZBV-style schedules."""
    n_stages = pp * stages_per_rank
    if schedule_class(schedule_name).__name__ in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ConfigError(
                f"strategy.pp_schedule={schedule_name} places exactly 2 stages per rank in a V: "
                f"set strategy.pp_stages_per_rank=2"
            )
        return [pp_rank, n_stages - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_layer_ranges(n_layers: int, n_stages: int, explicit: list[int]) -> list[range]:
    """Global block indices of each stage."""
    counts = pp_stage_layers(n_layers, n_stages, explicit)
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ConfigError(
            f"strategy.pp_layers_per_stage={counts} must list {n_stages} positive counts summing to "
            f"model.n_layers={n_layers}"
        )
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts, strict=True)]


def build_stage_modules(model: nn.Module, cfg: JobConfig, layout: Layout, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, stage module) for each stage this pipeline rank runs, in schedule order."""
    s = cfg.strategy
    n_stages = layout.pp * int(s.pp_stages_per_rank)
    ranges = stage_layer_ranges(int(cfg.model.n_layers), n_stages, list(s.pp_layers_per_stage))
    ids = stage_ids(pp_rank, layout.pp, int(s.pp_stages_per_rank), s.pp_schedule)
    from dtlaunch.models.registry import model_spec

    spec = model_spec(cfg.model)
    return [(i, spec.split_stage(model, i, n_stages, ranges[i])) for i in ids]


def build_schedule(
    stage_modules: list[tuple[int, nn.Module]],
    pp_mesh: DeviceMesh,
    cfg: JobConfig,
    dec: Decisions,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> PipelinePlan:
    """Wrap the (parallelised, materialised) stage modules in PipelineStages and build the schedule.

    `loss_fn(output, target)` runs on the last stage once per pipeline micro-batch. The schedule is
    built with scale_grads=False: gradients are the plain sum over micro-batches, so `loss_fn` must
    return its loss already divided by the number of micro-batches (dtlaunch.train.loss.pipeline_loss_fn).
    Shapes are inferred at the first step (no static example inputs), which also covers sequence-
    parallel activations of shape (B, S/tp, D) between stages.
    """
    n_stages = dec.layout.pp * int(cfg.strategy.pp_stages_per_rank)
    group = pp_mesh.get_group()
    reshard = bool(cfg.strategy.pp_reshard_grads)
    stages = [make_stage(module, idx, n_stages, device, group, reshard) for idx, module in stage_modules]
    cls = schedule_class(cfg.strategy.pp_schedule)
    n_mb = dec.pp_microbatches
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ConfigError(
                f"strategy.pp_schedule={cfg.strategy.pp_schedule} runs one stage per rank: set "
                f"strategy.pp_stages_per_rank=1"
            )
        schedule = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=False)
    ids = [idx for idx, _ in stage_modules]
    return PipelinePlan(
        schedule=schedule,
        model_parts=[module for _, module in stage_modules],
        has_first_stage=0 in ids,
        has_last_stage=n_stages - 1 in ids,
        stage_ids=ids,
    )


# The FSDPModule setters torch's stage calls with False around each backward.
_SYNC_SETTERS = ("set_is_last_backward", "set_requires_gradient_sync", "set_reshard_after_backward")


def set_fsdp_sync(module: FSDPModule, on: bool) -> None:
    """Reduce-scatter gradients and reshard parameters at the end of the next backward (`on`), or keep
    both unsharded for a later backward to add to."""
    for name in _SYNC_SETTERS:
        getattr(module, name)(on)


@contextlib.contextmanager
def _fsdp_sync_pinned_on(module: FSDPModule) -> Iterator[None]:
    set_fsdp_sync(module, True)
    # Instance attributes shadow the methods for the duration of the stage's backward, so that its
    # "sync off" calls do not undo the setting.
    for name in _SYNC_SETTERS:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in _SYNC_SETTERS:
            delattr(module, name)


class ReshardingStage(PipelineStage):
    """A PipelineStage whose FSDP module reduce-scatters after every micro-batch's backward."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full":
            # Validation refuses split-backward schedules with pp_reshard_grads (job.validate).
            raise RuntimeError(f"pp_reshard_grads needs full backward passes, got a '{backward_type}' pass")
        with _fsdp_sync_pinned_on(self.submod):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def make_stage(
    module: nn.Module, idx: int, n_stages: int, device: Any, group: Any, reshard_grads: bool
) -> PipelineStage:
    """The pipeline stage for one stage module under the configured gradient policy."""
    cls = ReshardingStage if reshard_grads and isinstance(module, FSDPModule) else PipelineStage
    return cls(module, idx, n_stages, device, group=group)
