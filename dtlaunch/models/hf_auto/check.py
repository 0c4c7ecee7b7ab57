"""`model.arch=hf_auto`'s rules: weights and architecture from a HF directory; tensor parallel only from the
architecture's own plan, no pipeline split."""

from __future__ import annotations

from typing import Any

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.errors import ConfigError


def check(cfg: Any) -> None:
    s = cfg.strategy
    if not WeightSource.parse(cfg.model.init_from).is_hf:
        raise ConfigError("model.arch=hf_auto needs model.init_from=hf:DIR: the architecture and weights come from DIR")
    if s.pp != 1:
        raise ConfigError(f"strategy.pp={s.pp}: model.arch=hf_auto has no pipeline split: use strategy.pp=1")
    if s.tp != 1:
        from dtlaunch.models.hf_auto.tp_plan import check as check_tp

        problem = check_tp(cfg.model, int(s.tp), bool(s.sequence_parallel))
        if problem:
            raise ConfigError(problem)
