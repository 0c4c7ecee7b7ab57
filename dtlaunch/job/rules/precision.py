"""precision: dtypes, loss scaling and float8."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check_precision(cfg: JobConfig, notes: list[str]) -> None:
    p = cfg.precision
    if p.param_dtype == "fp16" and not p.loss_scaling:
        raise ConfigError(
            "precision.param_dtype=fp16 needs loss scaling (gradients underflow): set precision.loss_scaling=true"
        )
    check_float8(cfg)
    if cfg.hardware.name == "cpu" and "fp16" in (p.param_dtype, p.reduce_dtype) and cfg.cluster.kind == "local":
        notes.append("fp16 on CPU is slow and poorly supported; bf16 is the better choice there")


def check_float8(cfg: JobConfig) -> None:
    p, hw = cfg.precision, cfg.hardware
    emulate = bool(p.float8_emulate)
    if p.float8 == "none":
        if emulate:
            raise ConfigError(
                "precision.float8_emulate=true emulates float8 matmuls, but precision.float8=none: "
                "set precision.float8=tensorwise (or rowwise), or precision.float8_emulate=false"
            )
        return
    if not hw.float8 and not emulate:
        raise ConfigError(
            f"precision.float8={p.float8} needs float8 tensor cores, which hardware={hw.name} does not have: "
            "use a Hopper/Ada/Blackwell profile (e.g. hardware=h100_80gb) or precision.float8=none "
            "(precision.float8_emulate=true runs its numerics without them, for tests only: no speed-up)"
        )
    if p.param_dtype != "bf16":
        raise ConfigError(
            f"precision.float8={p.float8} computes the rest in bf16: set precision=bf16 (param_dtype is {p.param_dtype})"
        )
    if emulate and cfg.training.compile:
        # torchao's emulation is for eager runs (torchtitan refuses the pair too).
        raise ConfigError("precision.float8_emulate=true runs eagerly only: set training.compile=false")


def check_float8_tensor_parallel(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    hw, la = cfg.hardware, cfg.launch
    gloo = la.backend == "gloo" or (la.backend == "auto" and int(hw.gpus_per_node) == 0)
    if cfg.precision.float8 == "tensorwise" and layout.tp > 1 and cfg.strategy.sequence_parallel and gloo:
        # torchao's float8 TP styles all-gather float8 activations under sequence parallel; gloo has no float8.
        raise ConfigError(
            "precision.float8=tensorwise with strategy.sequence_parallel=true all-gathers float8 activations, "
            "which gloo cannot: set strategy.sequence_parallel=false (or precision.float8=rowwise)"
        )
