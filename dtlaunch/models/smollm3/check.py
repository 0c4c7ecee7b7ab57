"""SmolLM3's rule on its model section, on top of the dense decoder's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.check import check as dense_check

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    dense_check(cfg)
    m = cfg.model
    layers = list(m.no_rope_layers or ())
    bad = [i for i in layers if not 0 <= int(i) < int(m.n_layers)]
    if bad or len(set(layers)) != len(layers):
        raise ConfigError(
            f"model.no_rope_layers={layers}: each entry must be a distinct block index in 0..{int(m.n_layers) - 1} "
            f"(model.n_layers={m.n_layers}): fix or remove the entries"
        )
