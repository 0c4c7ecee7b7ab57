"""YaRN RoPE scaling (DeepSeek-V3), numerically as transformers' `_compute_yarn_parameters`: per rotary pair
the inverse frequency blended between the original and the interpolated (/ factor) one, linearly over the
pairs between the dims that turn beta_fast and beta_slow times in the original context; and the factor
multiplying the cos/sin tables. `yarn` is a model section's YaRN fields (factor, original_max_seq_len,
beta_fast, beta_slow, mscale, mscale_all_dim)."""

from __future__ import annotations

import math
from typing import Any

import torch


def mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def attention_factor(yarn: Any) -> float:
    """What the cos/sin tables are multiplied by."""
    f = float(yarn.factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return mscale(f, float(yarn.mscale)) / mscale(f, float(yarn.mscale_all_dim))
    return mscale(f)


def yarn_frequencies(dim: int, theta: float, yarn: Any) -> torch.Tensor:
    """fp32 inverse frequencies of `dim` rotated dims (dim / 2 pairs)."""
    factor, original = float(yarn.factor), int(yarn.original_max_seq_len)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(float(yarn.beta_fast))), 0)
    high = min(math.ceil(correction_dim(float(yarn.beta_slow))), dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
