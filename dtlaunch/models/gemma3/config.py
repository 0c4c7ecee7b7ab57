"""Gemma 3's own model fields: norms around each sublayer with (1 + gain) RMSNorm, scaled embeddings, a
GELU-tanh gated MLP, its attention scale, and sliding-window blocks (`layer_types`) with a RoPE base of
their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dtlaunch.models.dense.config import DenseModelConfig


@dataclass
class Gemma3ModelConfig(DenseModelConfig):
    # A norm before and after each sublayer (the after one on its output, before the residual add).
    sandwich_norm: bool = True
    # Every RMSNorm multiplies by (norm_offset + gain), its gains initialised to zero (Gemma).
    norm_offset: float = 1.0
    # Token embeddings multiplied by sqrt(dim) (the tied head reads the unscaled matrix).
    embed_scale: bool = True
    # The MLP's gate activation: gelu_tanh (GELU, tanh approximation; the decoder also knows silu).
    mlp_activation: str = "gelu_tanh"
    # Attention scores divided by sqrt(this) instead of sqrt(head_dim); None: head_dim.
    query_pre_attn_scalar: Optional[float] = None
    # RoPE base of the sliding-window blocks (model.rope_theta is the full-attention blocks').
    rope_local_theta: float = 10000.0
    # The full-attention blocks' RoPE positions divided by this factor (Gemma 3 4B+: 8); None: unscaled.
    rope_linear_factor: Optional[float] = None
    # One entry per block, "sliding_attention" (within model.sliding_window) or "full_attention"; Gemma 3
    # slides in five blocks of six. Empty: every block uses model.sliding_window (or attends fully).
    layer_types: list[str] = field(default_factory=list)
