"""The dense decoder's own model fields (llama, qwen2, qwen3, mistral; the MoE decoder's attention too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtlaunch.config.schema import ModelConfig


@dataclass
class DenseModelConfig(ModelConfig):
    # Bias on the q/k/v projections (Qwen2 / Qwen2.5).
    qkv_bias: bool = False
    # Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool = False
    # Each token attends to at most this many previous positions (Mistral); None = full causal.
    sliding_window: Optional[int] = None
