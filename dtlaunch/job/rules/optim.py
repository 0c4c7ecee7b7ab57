"""Rules of the `optim` section's memory options (state dtype, low-bit AdamW, step in backward), run by
`validate` before any worker starts.

- `optim.state_dtype=bf16` keeps the AdamW moments in bf16 by training the parameters themselves in bf16
  (torch's AdamW keeps its moments in the parameter's dtype). That is honest for LoRA / QLoRA adapters
  (no fp32 master to keep); full training keeps fp32 master weights, so there it is refused and the
  low-bit optimizers are the way to shrink the state.
- `optim.name=adamw8bit|adamw4bit` needs torchao; ZeRO-1 (ZeroRedundancyOptimizer) and tensor / expert
  parallel are refused: not exercised with torchao's quantised state.
- `optim.in_backward=true` steps each parameter inside backward: nothing is left to accumulate or clip,
  and only single-process runs and FSDP2 over one shard dimension run the hooks at the right moment
  (DDP and ZeRO-1 reduce after the hook fires; HSDP, TP, CP, EP and PP are not wired for it).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.config.schema import JobConfig

LOWBIT = ("adamw8bit", "adamw4bit")


def check_optim(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    o = cfg.optim
    name, state = str(o.name), str(o.state_dtype)
    if name in LOWBIT:
        check_lowbit(cfg, layout, name)
    if state == "bf16":
        check_bf16_state(cfg, name)
    if o.in_backward:
        check_in_backward(cfg, d)


def check_lowbit(cfg: JobConfig, layout: Layout, name: str) -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"optim.name={name} needs the 'torchao' package: pip install 'dtlaunch[lowbit-optim]'")
    zero = int(cfg.strategy.zero_stage)
    if zero == 1 and layout.dp > 1:
        raise ConfigError(
            f"optim.name={name} with strategy.zero_stage=1: ZeroRedundancyOptimizer does not wrap torchao's "
            "optimizer here; use strategy.zero_stage=2 or 3 (FSDP2 shards the quantised state too)"
        )
    for key, value in (("strategy.tp", layout.tp), ("strategy.ep", layout.ep)):
        if value > 1:
            raise ConfigError(
                f"optim.name={name} with {key}={value}: the quantised state is supported on single-process, "
                f"DDP and FSDP2 layouts only; set {key}=1 or optim.name=adamw"
            )


def check_bf16_state(cfg: JobConfig, name: str) -> None:
    if name != "adamw":
        raise ConfigError(
            f"optim.state_dtype=bf16 with optim.name={name}: its moments are already quantised; "
            "set optim.state_dtype=fp32"
        )
    if str(cfg.peft.method) == "none":
        raise ConfigError(
            "optim.state_dtype=bf16 with peft.method=none: full training keeps fp32 master weights and AdamW "
            "keeps its moments in their dtype; use optim.name=adamw8bit|adamw4bit, or peft=lora"
        )
    if str(cfg.precision.param_dtype) != "bf16":
        raise ConfigError(
            f"optim.state_dtype=bf16 trains the adapters in bf16, which needs precision.param_dtype=bf16 "
            f"(it is {cfg.precision.param_dtype}): set precision=bf16 or optim.state_dtype=fp32"
        )


def check_in_backward(cfg: JobConfig, d: Decisions) -> None:
    layout, accum = d.layout, d.grad_accum
    if accum > 1:
        raise ConfigError(
            f"optim.in_backward=true with {accum} gradient accumulation micro-steps (training.global_batch="
            f"{cfg.training.global_batch}): each micro-step would update; set training.global_batch=0"
        )
    if float(cfg.training.grad_clip) > 0:
        raise ConfigError(
            f"optim.in_backward=true with training.grad_clip={cfg.training.grad_clip}: the global norm is known "
            "only after every update ran; set training.grad_clip=0"
        )
    if bool(cfg.precision.loss_scaling):
        raise ConfigError(
            "optim.in_backward=true with precision.loss_scaling=true: the scaler unscales before a step that "
            "has already run; use precision=bf16 or optim.in_backward=false"
        )
    if bool(cfg.strategy.cpu_offload):
        # Untested together: FSDP2 moves each gradient shard to the host after the hook would have stepped.
        raise ConfigError(
            "optim.in_backward=true with strategy.cpu_offload=true: the step in backward runs on device "
            "gradients only; set strategy.cpu_offload=false or optim.in_backward=false"
        )
    zero = int(cfg.strategy.zero_stage)
    if zero <= 1 and layout.dp > 1:
        raise ConfigError(
            f"optim.in_backward=true with strategy.zero_stage={zero} over {layout.dp} ranks: DDP reduces a "
            "gradient after its hook ran; use strategy.zero_stage=2 or 3 (FSDP2)"
        )
    for key, value in (
        ("strategy.dp_replicate", layout.dp_replicate if layout.dp_shard > 1 else 1),
        ("strategy.tp", layout.tp),
        ("strategy.pp", layout.pp),
        ("strategy.cp", layout.cp),
        ("strategy.ep", layout.ep),
    ):
        if value > 1:
            raise ConfigError(
                f"optim.in_backward=true with {key}={value}: supported on one process or FSDP2 over one shard "
                f"dimension only; set {key}=1 or optim.in_backward=false"
            )
