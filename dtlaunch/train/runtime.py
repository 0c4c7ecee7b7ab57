"""The training runtime as one object, built from the resolved config: the mesh, the parallelised model
parts (or this rank's pipeline stages), their optimizers and LR schedulers, the loss scaler, and the step
function over them. The worker (dtlaunch.train.main) and `plan --trace` (dtlaunch.plan.trace) build the
same object; the trace asks for parameters allocated but not initialised (fake tensors have no values)
and for its optimizer's GPU kernel choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from dtlaunch.config.layout import Layout, grad_accum_steps
from dtlaunch.train.parallel.process_group import DistEnv
from dtlaunch.train.step import StepContext, StepResult, train_step


@dataclass
class Runtime:
    cfg: Any
    layout: Layout
    mesh: Any
    device: torch.device
    accum: int
    model_parts: list
    optimizers: list
    schedulers: list
    scaler: Optional[Any] = None
    pipeline: Optional[Any] = None  # dtlaunch.train.parallel.pipeline.PipelinePlan
    pipeline_loss: Optional[Any] = None
    pp_mesh: Optional[Any] = None

    def step_context(self, loader: Any, moe: Any = None) -> StepContext:
        """What `train_step` needs, reading batches from `loader` (None: the caller feeds micro-steps);
        `moe`: an MoE model's router tracker (dtlaunch.train.moe_stats)."""
        from dtlaunch.train.parallel.tensor_parallel import loss_context

        cfg, layout = self.cfg, self.layout
        return StepContext(
            cfg=cfg,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            loader=loader,
            device=self.device,
            accum=self.accum,
            loss_context=lambda: loss_context(cfg, layout),
            pipeline=self.pipeline,
            pipeline_loss=self.pipeline_loss,
            pp_mesh=self.pp_mesh,
            scaler=self.scaler,
            moe=moe,
        )

    def step(self, ctx: StepContext, step: int) -> StepResult:
        """One optimizer step (forward/backward over the accumulation micro-steps, clip, step)."""
        return train_step(ctx, step)


def build_runtime(
    cfg: Any,
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
    from dtlaunch.train.main import build_parts
    from dtlaunch.train.optim import build_grad_scaler, build_optimizer, build_scheduler
    from dtlaunch.train.parallel.mesh import build_mesh, dp_mesh

    layout = layout if layout is not None else Layout.resolve(cfg.strategy, env.world)
    mesh = mesh if mesh is not None else build_mesh(layout, env.device.type)
    accum = grad_accum_steps(cfg, layout)
    built = build_parts(cfg, layout, mesh, env, accum, init=init)
    parts = built["model_parts"]
    zero1 = dp_mesh(mesh, flatten=True) if cfg.strategy.zero_stage == 1 else None
    group = zero1.get_group() if zero1 is not None else None
    optimizers = [build_optimizer(p, cfg, env.device, group, fused) for p in parts]
    return Runtime(
        cfg=cfg,
        layout=layout,
        mesh=mesh,
        device=env.device,
        accum=accum,
        model_parts=parts,
        optimizers=optimizers,
        schedulers=[build_scheduler(o, cfg) for o in optimizers],
        scaler=build_grad_scaler(cfg, env.device) if loss_scaler else None,
        pipeline=built.get("pipeline"),
        pipeline_loss=built.get("pipeline_loss"),
        pp_mesh=built.get("pp_mesh"),
    )
