"""Rules for the long-context savers (`training.mlp_tiles`, `precision.residual_dtype`): combinations the runtime cannot run are
refused in one line before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.registry import model_spec

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check_mlp_tiles(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    n = int(cfg.training.mlp_tiles)
    if n <= 1:
        return
    if d.layout.tp > 1 and cfg.strategy.sequence_parallel:
        # The MLP's input is then a sequence-sharded DTensor that TP's styles gather inside the MLP.
        raise ConfigError(
            f"training.mlp_tiles={n} does not combine with strategy.sequence_parallel=true: "
            "set strategy.sequence_parallel=false (or training.mlp_tiles=1)"
        )
    if not model_spec(cfg.model).ring_attention:  # the registry's own decoders (dense and MoE blocks)
        raise ConfigError(
            f"training.mlp_tiles={n} tiles a registry decoder's SwiGLU MLP: use training.mlp_tiles=1 for this model"
        )


def check_residual_dtype(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    p = cfg.precision
    want = str(p.residual_dtype)
    if want == "auto":
        return
    if want == "fp32":
        if str(p.param_dtype) != "fp32" and not d.autocast:
            # FSDP's mixed-precision policy casts every block's input to the compute dtype.
            raise ConfigError(
                f"precision.residual_dtype=fp32 is not supported under FSDP with precision.param_dtype="
                f"{p.param_dtype} (FSDP casts each block's input to it): use precision.residual_dtype=auto"
            )
        return
    if want != str(p.param_dtype):
        raise ConfigError(
            f"precision.residual_dtype={want} keeps the residual stream in the compute dtype, but "
            f"precision.param_dtype={p.param_dtype}: set precision.param_dtype={want} or precision.residual_dtype=auto"
        )
    if not d.residual_in_compute_dtype:
        return  # FSDP's mixed precision already keeps it there
    if not model_spec(cfg.model).ring_attention:  # the registry's own decoders
        raise ConfigError(
            f"precision.residual_dtype={want} is applied by the registry's decoders, not model.arch="
            f"{cfg.model.arch}: use precision.residual_dtype=auto"
        )
    if d.layout.pp > 1:
        raise ConfigError(
            f"precision.residual_dtype={want} is not supported with strategy.pp={d.layout.pp} (the stages "
            f"exchange fp32 hidden states): use strategy.pp=1 or precision.residual_dtype=auto"
        )
