"""AdamW and its learning-rate schedule, built from the `optim` section.

Weight decay applies to matrices only (2-D+: linear and embedding weights), never to norm gains.
The schedule is linear warmup to optim.lr, then cosine / linear decay to lr * min_lr_ratio at the last
step (or constant).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def param_groups(params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decayed matrices, then undecayed gains. A group holding both plain tensors and DTensors (a
    tensor-parallel plan that leaves some matrices whole, as hf_auto's) is split by kind: foreach
    kernels refuse a mix."""
    groups = []
    trainable = [p for _, p in params if p.requires_grad]
    for decay in (True, False):
        by_kind: dict[bool, list] = {}
        for p in trainable:
            if (p.ndim >= 2) == decay:
                by_kind.setdefault(hasattr(p, "device_mesh"), []).append(p)
        for ps in by_kind.values() or [[]]:
            groups.append({"params": ps, "weight_decay": weight_decay if decay else 0.0})
    # No empty group (LoRA trains matrices only): a flattened optimizer state dict cannot load one.
    return [g for g in groups if g["params"]] or groups[:1]


def adamw_kwargs(cfg: JobConfig, device: torch.device, fused: Optional[bool] = None) -> dict:
    """fused (one kernel, no temporaries) on CUDA; foreach elsewhere: on CPU it is the path the planner's
    CPU measurements were taken with. `fused` overrides the choice (the trace replays a GPU run on CPU)."""
    o = cfg.optim
    kw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    if fused is None:
        fused = device.type == "cuda"
    kw.update({"fused": True} if fused else {"foreach": True})
    return kw


def build_optimizer(
    model: nn.Module,
    cfg: JobConfig,
    device: torch.device,
    zero1_group: Optional[Any] = None,
    fused: Optional[bool] = None,
) -> torch.optim.Optimizer:
    """AdamW; with zero1_group, ZeroRedundancyOptimizer shards its state over those data-parallel ranks.
    optim.name=adamw8bit|adamw4bit: torchao's (dtlaunch.train.features.optim_lowbit; ZeRO-1 refused by validate)."""
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    if str(cfg.optim.name) != "adamw":
        from dtlaunch.train.features.optim_lowbit import lowbit_adamw

        return lowbit_adamw(groups, cfg)
    kw = adamw_kwargs(cfg, device, fused)
    if zero1_group is None:
        return torch.optim.AdamW(groups, **kw)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # ZeroRedundancyOptimizer takes the first group at construction and the rest via add_param_group.
    opt = ZeroRedundancyOptimizer(
        groups[0]["params"],
        optimizer_class=torch.optim.AdamW,
        process_group=zero1_group,
        weight_decay=groups[0]["weight_decay"],
        **kw,
    )
    for group in groups[1:]:
        opt.add_param_group(group)
    return opt


def lr_lambda(cfg: JobConfig) -> Callable[[int], float]:
    """Multiplier of optim.lr at a 0-based optimizer step."""
    # Plain values, read once: LambdaLR calls this for every parameter group at every step, and an
    # OmegaConf attribute read costs tens of microseconds.
    total, warmup = int(cfg.training.steps), int(cfg.optim.warmup_steps)
    schedule, floor = str(cfg.optim.schedule), float(cfg.optim.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> torch.optim.lr_scheduler.LambdaLR:
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # An optimizer that keeps lr as a tensor (torchao's) hands the scheduler tensor base lrs: plain
    # numbers instead, so the schedule computes the same values before and after a resume (its state is
    # saved as JSON numbers) and the tensor is filled in place.
    sched.base_lrs = [float(lr) for lr in sched.base_lrs]
    return sched


def build_grad_scaler(cfg: JobConfig, device: torch.device, group: Optional[Any] = None) -> Optional[Any]:
    """Dynamic loss scaling for fp16 (precision.loss_scaling); the sharded scaler agrees on inf/NaN
    across ranks so every rank skips the same steps."""
    if not cfg.precision.loss_scaling:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type, process_group=group)


def skips_on_device(opt: Any) -> bool:
    """A fused torch Adam/AdamW can skip a step inside its kernel (its `found_inf` input, the path
    GradScaler uses), so a non-finite gradient norm needs no host sync. Only on accelerators: on CPU the
    runtime keeps foreach (what the planner's CPU measurements were taken with) and decides on the host."""
    return isinstance(opt, torch.optim.Adam) and bool(opt.defaults.get("fused")) and _on_accelerator(opt)


def _on_accelerator(opt: torch.optim.Optimizer) -> bool:
    for group in opt.param_groups:
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            return local.device.type not in ("cpu", "meta")
    return False


def step_unless_nonfinite(opt: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """`opt.step()`, which leaves parameters, moments and step counts as they were when `grad_norm` is
    not finite; decided on the device (fused Adam/AdamW only, see `skips_on_device`)."""
    opt.found_inf = (~torch.isfinite(grad_norm)).float()  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.found_inf  # type: ignore[attr-defined]
