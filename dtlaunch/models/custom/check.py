"""`model._target_`'s rules: importable, returns an nn.Module with `layers` (built on the meta device), and
a layout it can run: no tensor-parallel plan, no pipeline split, no Hugging Face weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    m, s = cfg.model, cfg.strategy
    for key, value in (("strategy.tp", s.tp), ("strategy.pp", s.pp)):
        if value != 1:
            raise ConfigError(
                f"{key}={value}: model._target_ modules have no tensor-parallel plan or pipeline split: use {key}=1"
            )
    if str(m.init_from) != "random":
        raise ConfigError(
            f"model.init_from={m.init_from} with model._target_: load weights inside your build function instead"
        )
    from dtlaunch.models.custom.build import build_model

    build_model(m, device="meta")
