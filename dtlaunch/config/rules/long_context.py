"""Rules for the long-context savers (`training.mlp_tiles`): combinations the runtime cannot run are
refused in one line before anything starts."""

from __future__ import annotations

from typing import Any

from dtlaunch.config.layout import Layout
from dtlaunch.errors import ConfigError
from dtlaunch.models.registry import model_spec


def check_mlp_tiles(cfg: Any, layout: Layout, notes: list[str]) -> None:
    n = int(cfg.training.mlp_tiles)
    if n <= 1:
        return
    if layout.tp > 1 and cfg.strategy.sequence_parallel:
        # The MLP's input is then a sequence-sharded DTensor that TP's styles gather inside the MLP.
        raise ConfigError(
            f"training.mlp_tiles={n} does not combine with strategy.sequence_parallel=true: "
            "set strategy.sequence_parallel=false (or training.mlp_tiles=1)"
        )
    if not model_spec(cfg.model).ring_attention:  # the registry's own decoders (dense and MoE blocks)
        raise ConfigError(
            f"training.mlp_tiles={n} tiles a registry decoder's SwiGLU MLP: use training.mlp_tiles=1 for this model"
        )
