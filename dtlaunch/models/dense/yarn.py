"""YaRN RoPE scaling (Peng et al. 2023), numerically as transformers' `_compute_yarn_parameters`, for every
family that has it (gpt-oss's `rope_yarn`, DeepSeek-V3's `yarn`): per rotary pair the inverse frequency
blended between the original and the interpolated (/ factor) one, linearly over the pairs between the dims
that turn beta_fast and beta_slow times in the original context (the ends rounded to whole dims unless
`truncate` is false, as gpt-oss's config.json says); and the factor multiplying the cos/sin tables
(`attention_factor` if set, else mscale(mscale) / mscale(mscale_all_dim) where both are set, else
0.1 ln(factor) + 1)."""

from __future__ import annotations

import math
from typing import Any

import torch


def mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def attention_factor(yarn: Any) -> float:
    """What the cos/sin tables are multiplied by."""
    f = float(yarn.factor)
    fixed = getattr(yarn, "attention_factor", None)
    if fixed is not None:
        return float(fixed)
    if getattr(yarn, "mscale", 0) and getattr(yarn, "mscale_all_dim", 0):
        return mscale(f, float(yarn.mscale)) / mscale(f, float(yarn.mscale_all_dim))
    return mscale(f)


def yarn_frequencies(dim: int, theta: float, yarn: Any) -> torch.Tensor:
    """fp32 inverse frequencies of `dim` rotated dims (dim / 2 pairs)."""
    factor, original = float(yarn.factor), int(yarn.original_max_seq_len)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(float(yarn.beta_fast)), correction_dim(float(yarn.beta_slow))
    if getattr(yarn, "truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
