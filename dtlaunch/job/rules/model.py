"""The model section's own rules: its shape against the registry entry of its family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check_model_shape(cfg: JobConfig, notes: list[str]) -> None:
    """The fields the model's family fixes, then the family's own rules (its registry entry's `check`)."""
    from omegaconf import OmegaConf

    from dtlaunch.models.registry import model_spec

    m = cfg.model
    spec = model_spec(m)
    for key, value in spec.fixed.items():
        if OmegaConf.select(m, key) != value:
            raise ConfigError(
                f"model.{key}={OmegaConf.select(m, key)} does not fit model.arch={m.arch} (which has {key}={value}): "
                f"drop the override or pick the model.arch that has it"
            )
    spec.check_config(cfg)


def check_model_layout(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    """The family's own rules on the resolved layout (its registry entry's `check_layout`)."""
    from dtlaunch.models.registry import model_spec

    model_spec(cfg.model).check_config_layout(cfg, d)
