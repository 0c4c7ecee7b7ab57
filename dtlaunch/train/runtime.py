"""The training runtime as one object, built once from the resolved config: the mesh, the parallelised
model parts (or this rank's pipeline stages), their optimizers and LR schedulers, the loss scaler, an MoE
model's router tracker, and the values the step reads every time. `train_step` (dtlaunch.train.step) runs
one optimizer step over it.

The worker's Trainer and `plan --trace` (dtlaunch.plan.trace) build the same object with `build_runtime`
and run the same `train_step`; the trace asks for parameters allocated but not initialised (fake tensors
have no values), for its optimizer's GPU kernel choice, and for no host reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.models.registry import model_spec
from dtlaunch.train.loss import head_loss, loss_context, pipeline_loss_fn
from dtlaunch.train.objectives.sft import NextTokenObjective
from dtlaunch.train.parallel.process_group import DistEnv

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.objectives import Objective


@dataclass
class Runtime:
    cfg: JobConfig
    decisions: Decisions  # what the job decides once (config.decisions), as the planner read it
    mesh: Any  # None for the single-process reference in the tests
    device: torch.device
    model_parts: list
    optimizers: list
    schedulers: list
    scaler: Optional[Any] = None
    pipeline: Optional[Any] = None  # dtlaunch.train.parallel.pipeline.PipelinePlan
    pipeline_loss: Optional[Any] = None  # dtlaunch.train.loss.PipelineLoss
    pp_mesh: Optional[Any] = None
    moe: Optional[Any] = None  # dtlaunch.train.features.moe_stats.RouterTracker for MoE models
    loss_context: Callable[[], Any] = field(default=contextlib.nullcontext)
    # The job's objective (dtlaunch.train.objectives; next-token cross-entropy unless told) and the
    # reference model that runs beside it (DPO, KTO), if any.
    objective: Objective = field(default_factory=NextTokenObjective)
    reference: Optional[Any] = None
    in_backward: Optional[Any] = None  # dtlaunch.train.features.optim_in_backward.InBackward (optim.in_backward)
    # (output, targets, reduction) -> loss: the model's logits or, with training.loss_chunks > 1, its
    # hidden states through the head chunk by chunk (dtlaunch.train.loss). Set from the config.
    loss_fn: Callable[..., Any] = field(init=False)

    @property
    def layout(self) -> Layout:
        return self.decisions.layout

    @property
    def accum(self) -> int:
        """Micro-steps per optimizer step."""
        return self.decisions.grad_accum

    def __post_init__(self) -> None:
        from dtlaunch.train.optim import skips_on_device
        from dtlaunch.train.parallel.float8 import scale_precompute

        # Read once: OmegaConf attribute access costs tens of microseconds per step.
        self.grad_clip = float(self.cfg.training.grad_clip)
        self.skip_on_device = self.scaler is None and all(skips_on_device(o) for o in self.optimizers)
        # Float8 weights all-gathered by FSDP: their scales, recomputed after every optimizer step.
        self.float8_scales = scale_precompute(self.model_parts) if self.cfg.precision.float8 != "none" else None
        # The parameters whose gradients are clipped, listed once: walking the module tree costs more
        # than the norm itself on a small model. After parallelize the registered parameters are final
        # (FSDP2 registers its sharded ones, which hold the gradients, between steps).
        self.params = [list(m.parameters()) for m in self.model_parts]
        self.loss_fn = head_loss(self.decisions.loss_chunks, self.model_parts)


def build_model_parts(
    cfg: JobConfig, dec: Decisions, mesh: Any, env: DistEnv, objective: Objective, init: bool = True
) -> dict:
    """The model (or this rank's pipeline stages), parallelised and initialised (allocated only with
    init=False). Under pipeline parallel the last stage's loss is the job's `objective`'s (`pipeline_loss`)."""
    from dtlaunch.train.features.peft import apply_peft
    from dtlaunch.train.parallel.parallelize import parallelize

    layout = dec.layout

    # RoPE tables for the positions training uses, not the model's maximum (131,072 on Llama-3.1).
    model = model_spec(cfg.model).build(cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
    trained_in_full: tuple[str, ...] = ()
    if cfg.objective.name == ObjectiveName.reward:  # a scalar head in place of the LM head, trained in full under LoRA
        from dtlaunch.models.score_head import add_score_head

        trained_in_full = add_score_head(model)
    # Adapters + frozen base (peft.method != none), before any layout is applied.
    apply_peft(model, cfg, trained_in_full)
    if layout.pp == 1:
        return {"model_parts": [parallelize(model, mesh, cfg, dec, init=init)]}
    from dtlaunch.train.parallel.pipeline import build_schedule, build_stage_modules

    pp_mesh = mesh["pp"]
    parts = build_stage_modules(model, cfg, layout, pp_mesh.get_local_rank())
    parts = [(i, parallelize(part, mesh, cfg, dec, init=init)) for i, part in parts]
    loss = pipeline_loss_fn(
        head_loss(dec.loss_chunks, [p for _, p in parts], pipeline=True), dec.pp_microbatches, dec.grad_accum
    )
    loss = objective.pipeline_loss(loss)  # the DPO family scores each pipeline micro-batch's pairs
    plan = build_schedule(parts, pp_mesh, cfg, dec, loss, env.device)
    return {"model_parts": plan.model_parts, "pipeline": plan, "pipeline_loss": loss, "pp_mesh": pp_mesh}


def build_runtime(
    cfg: JobConfig,
    env: DistEnv,
    layout: Optional[Layout] = None,
    mesh: Any = None,
    *,
    init: bool = True,
    fused: Optional[bool] = None,
    loss_scaler: bool = True,
) -> Runtime:
    """The runtime of this rank. `layout` / `mesh` default to the config's on env's world; `init=False`
    allocates the parameters without their initial values; `fused` overrides the optimizer's kernel
    choice (see dtlaunch.train.optim.adamw_kwargs); `loss_scaler=False` leaves fp16 loss scaling out."""
    from dtlaunch.train.optim import build_grad_scaler, build_optimizer, build_scheduler
    from dtlaunch.train.parallel.mesh import build_mesh, dp_mesh

    layout = layout if layout is not None else Layout.resolve(cfg.strategy, env.world)
    dec = Decisions.of(cfg, layout)
    mesh = mesh if mesh is not None else build_mesh(layout, env.device.type)
    from dtlaunch.train.objectives import build_objective
    from dtlaunch.train.objectives.reference import build_reference, cp_group

    objective = build_objective(cfg, dec, cp_group(mesh))
    built = build_model_parts(cfg, dec, mesh, env, objective, init=init)
    parts = built["model_parts"]
    zero1 = dp_mesh(mesh, flatten=True) if cfg.strategy.zero_stage == 1 else None
    group = zero1.get_group() if zero1 is not None else None
    optimizers = [build_optimizer(p, cfg, env.device, group, fused) for p in parts]

    in_backward = None
    if cfg.optim.in_backward:
        from dtlaunch.train.features.optim_in_backward import InBackward

        # The norm's squares are summed over the FSDP shard group (validate allows no other layout).
        norm_group = dp_mesh(mesh, flatten=True).get_group() if layout.dp > 1 else None
        in_backward = InBackward(parts, optimizers, norm_group)
    return Runtime(
        cfg=cfg,
        decisions=dec,
        mesh=mesh,
        device=env.device,
        model_parts=parts,
        optimizers=optimizers,
        schedulers=[build_scheduler(o, cfg) for o in optimizers],
        scaler=build_grad_scaler(cfg, env.device) if loss_scaler else None,
        pipeline=built.get("pipeline"),
        pipeline_loss=built.get("pipeline_loss"),
        pp_mesh=built.get("pp_mesh"),
        moe=_router_tracker(cfg, parts, mesh, dec),
        loss_context=lambda: loss_context(cfg, layout),
        objective=objective,
        reference=build_reference(cfg, dec, mesh, parts, init=init),
        in_backward=in_backward,
    )


def _router_tracker(cfg: JobConfig, parts: list, mesh: Any, dec: Decisions) -> Any:
    """Balancing and router statistics of an MoE model (None for dense ones). The aux loss's gradient
    is scaled like the loss: by 1 / the micro-batches (pipeline ones included) summed into a step."""
    from dtlaunch.train.features.moe_stats import RouterTracker
    from dtlaunch.train.parallel.mesh import dp_mesh

    # The data-parallel group only for the bias update (the statistics ride on the loop's window sync).
    moe = getattr(cfg.model, "moe", None)  # the MoE family's section; dense families have none
    dp = dp_mesh(mesh, flatten=True) if moe is not None and float(moe.bias_update_rate) > 0 else None
    layout = dec.layout
    n_mb = dec.pp_microbatches if layout.pp > 1 else 1
    group = dp.get_group() if dp is not None else None
    return RouterTracker.maybe(cfg, parts, group, layout.tp, 1.0 / (dec.grad_accum * n_mb), pipeline=layout.pp > 1)
