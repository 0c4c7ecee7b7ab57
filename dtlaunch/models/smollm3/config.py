"""SmolLM3's own model field: the layers whose attention has no RoPE (NoPE layers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtlaunch.models.dense.config import DenseModelConfig


@dataclass
class SmolLM3ModelConfig(DenseModelConfig):
    # Block indices (0-based) whose q and k are not rotated: SmolLM3-3B leaves every fourth layer
    # (3, 7, 11, ...) without positional encoding. Empty: RoPE in every layer.
    no_rope_layers: list[int] = field(default_factory=list)
