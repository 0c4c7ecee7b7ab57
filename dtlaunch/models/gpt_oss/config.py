"""gpt-oss's own model fields: the MoE decoder's, plus attention sinks, a bias on the attention output,
alternating sliding-window / full blocks, YaRN RoPE, a biased router and biased experts with a clamped SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dtlaunch.models.moe.config import MoeModelConfig


@dataclass
class YarnConfig:
    """YaRN RoPE scaling (transformers' rope_type "yarn"): frequencies between the dims turning beta_fast and
    beta_slow times over the original context are blended from unscaled to divided by `factor`; cos and sin
    are scaled by attention_factor (None: 0.1 ln(factor) + 1)."""

    factor: float = 32.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Round the ramp's ends to whole dims (transformers' default; gpt-oss's config.json says false).
    truncate: bool = False
    attention_factor: Optional[float] = None


@dataclass
class GptOssModelConfig(MoeModelConfig):
    # A bias on the attention output projection (o_proj); config.json's attention_bias sets it with model.qkv_bias.
    attention_out_bias: bool = True
    # A learned logit per head in each softmax denominator (weight taken from the keys, no value added).
    attention_sinks: bool = True
    # One entry per block, sliding_attention (within model.sliding_window) or full_attention; gpt-oss
    # alternates, sliding first. Empty: every block uses model.sliding_window (or attends fully).
    layer_types: list[str] = field(default_factory=list)
    rope_yarn: Optional[YarnConfig] = None
    # The router's logits have a learned bias (part of the scores, unlike moe.bias_update_rate's).
    router_bias: bool = True
    # Each expert projection has a bias.
    expert_biases: bool = True
    # Clamped SwiGLU of the experts: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    swiglu_alpha: float = 1.702
    swiglu_limit: Optional[float] = 7.0
