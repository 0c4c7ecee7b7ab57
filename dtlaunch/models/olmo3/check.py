"""OLMo 3's rules on its model section, on top of the dense decoder's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.check import check as dense_check

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

_KINDS = ("sliding_attention", "full_attention")


def check(cfg: JobConfig) -> None:
    dense_check(cfg)
    check_layer_types(cfg.model)


def check_layer_types(m: Any) -> None:
    """`model.layer_types`: empty, or one known kind per block (OLMo 3, Gemma 3)."""
    kinds = list(m.layer_types or ())
    if kinds and (len(kinds) != int(m.n_layers) or any(k not in _KINDS for k in kinds)):
        raise ConfigError(
            f"model.layer_types={kinds}: give one entry per block (model.n_layers={m.n_layers}), each "
            f"sliding_attention or full_attention, or an empty list"
        )
