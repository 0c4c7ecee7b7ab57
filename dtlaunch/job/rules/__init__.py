"""Cross-field rules by config section, one module each (model, strategy, precision, training, optim, peft,
qlora, offload, objective, data, checkpoint, launch, run); dtlaunch.job.validate runs them in order."""

from __future__ import annotations

import importlib.util
from typing import Any

from dtlaunch.errors import ConfigError


def need_package(module: Any, what: str, extra: str) -> None:
    """An optional library a setting needs is a validate-time error naming the extra, not a worker crash."""
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the '{module}' package: pip install 'dtlaunch[{extra}]'")
