"""Float8 training of the blocks' linears through torchao (`precision.float8=tensorwise|rowwise`).

Validation refuses float8 on hardware profiles without float8 tensor cores; this is the runtime's own
check of the device it actually got (a job planned for an H100 that lands on an A100), then the swap
of every block linear for torchao's Float8Linear. It runs on the meta model before any other
parallelisation, as torchao expects. The output head stays in bf16 (its logits feed the loss), and
linears whose dimensions are not multiples of 16 (float8 matmul kernels need that) are skipped.
torchao is imported only here: `pip install 'dtlaunch[float8]'`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtlaunch.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer


def apply_float8(model: nn.Module, recipe: str, device: torch.device) -> None:
    if recipe == "none":
        return
    check_device(recipe, device)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(
            f"precision.float8={recipe} needs torchao, which is not installed: pip install 'dtlaunch[float8]'"
        ) from exc
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=_convert)


def check_device(recipe: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(f"precision.float8={recipe} needs a CUDA GPU with float8 tensor cores, not {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ConfigError(
            f"precision.float8={recipe} needs float8 tensor cores (compute capability 8.9+); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: set precision.float8=none"
        )


def _convert(module: Any, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0
