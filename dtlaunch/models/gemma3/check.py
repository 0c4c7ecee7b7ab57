"""Gemma 3's rules on its model section, on top of the dense decoder's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.check import check as dense_check
from dtlaunch.models.olmo3.check import check_layer_types

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    m, cp = cfg.model, int(cfg.strategy.cp)
    window, seq = m.sliding_window, int(cfg.training.seq_len)
    if cp > 1 and window is not None and window < seq:
        raise ConfigError(
            f"strategy.cp={cp}: model.arch=gemma3 slides its attention within model.sliding_window={window} < "
            f"training.seq_len={seq}, which context parallel's plain causal attention cannot: set "
            f"training.seq_len<={window} or strategy.cp=1"
        )
    dense_check(cfg)
    check_layer_types(m)
    if m.rope_scaling is not None:
        raise ConfigError(
            "model.rope_scaling is Llama 3.1's, not Gemma 3's: remove it (model.rope_linear_factor scales the "
            "full-attention layers' RoPE)"
        )
