"""DeepSeek-V3's own model fields: the MoE decoder's, plus multi-head latent attention (MLA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtlaunch.models.moe.config import MoeModelConfig


@dataclass
class YarnConfig:
    """YaRN RoPE scaling (DeepSeek-V3's rope_scaling, type yarn), as transformers computes it: the
    frequencies blended between interpolated (/ factor) and original over a ramp set by beta_fast /
    beta_slow rotations in original_max_seq_len; cos/sin times mscale(mscale) / mscale(mscale_all_dim)
    (0: absent, then mscale(1)); the softmax scale times mscale(mscale_all_dim)^2."""

    factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass
class DeepseekV3ModelConfig(MoeModelConfig):
    # Low-rank queries: dim -> q_lora_rank -> RMSNorm -> heads (None: one dim -> heads projection).
    q_lora_rank: Optional[int] = 1536
    # Width of the compressed key/value latent each position keeps (before the per-head up-projection).
    kv_lora_rank: int = 512
    # Per head: key/query dims without RoPE, dims with RoPE (one rotated key shared by the heads), value dims.
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE over interleaved pairs (2i, 2i+1) as DeepSeek's checkpoints lay them out; False: halves (i, i + d/2).
    rope_interleave: bool = True
    # YaRN RoPE scaling (None: plain RoPE).
    yarn: Optional[YarnConfig] = None
