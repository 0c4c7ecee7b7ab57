"""Build a user module from `model._target_` and give it the protocol's defaults where it has none.

Defaults: `init_param(name, shape, seed)` draws N(0, 0.02) for matrices, zeros for biases and ones for
other vectors (norm gains), keyed by (seed, name) like the native decoder, so every layout starts
from the same weights; `buffer_values(device)` builds the module once on `device` and returns its
buffers (a module whose buffers are derived from its config needs nothing else).
"""

from __future__ import annotations

import importlib
import types
import zlib
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


def resolve_target(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"model._target_='{path}' is not a dotted path: use pkg.module.function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure of user code is bad input here
        raise ConfigError(
            f"model._target_='{path}': cannot import {module_name} ({type(exc).__name__}: {exc}): "
            f"make it importable (PYTHONPATH) or fix the name"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model._target_='{path}': {module_name} has no callable '{attr}'")
    return fn


def build_model(m: ModelConfig, rope_len: Optional[int] = None, device: Any = "meta") -> nn.Module:
    fn = resolve_target(str(m._target_))
    with torch.device(device):
        module = fn(m)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model._target_='{m._target_}' returned {type(module).__name__}, not an nn.Module: return the model"
        )
    if not isinstance(getattr(module, "layers", None), nn.ModuleDict):
        raise ConfigError(
            f"model._target_='{m._target_}': the module has no `layers` ModuleDict (its blocks, keyed by index), "
            f"which FSDP and activation checkpointing wrap: see docs/models.md"
        )
    module.cfg = m
    module.rope_len = rope_len
    if not hasattr(module, "init_param"):
        module.init_param = types.MethodType(default_init_param, module)
    if not hasattr(module, "buffer_values"):
        module.buffer_values = types.MethodType(_default_buffer_values, module)
    return module


def default_init_param(self: nn.Module, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if len(shape) == 1:
        return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=g).mul_(0.02)


def _default_buffer_values(self: nn.Module, device: Any = None) -> dict[str, torch.Tensor]:
    if not any(True for _ in self.named_buffers()):
        return {}
    fresh = resolve_target(str(self.cfg._target_))(self.cfg).to(device or "cpu")
    return dict(fresh.named_buffers())
