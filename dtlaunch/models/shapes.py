"""Closed-form model shapes and parameter counts (pure Python, shared by planner and validators)."""

from __future__ import annotations

import math
from typing import Any


def ffn_dim(m: Any) -> int:
    """SwiGLU hidden width, Meta's rule: multiple_of * ceil(int(mult * floor(8*dim/3)) / multiple_of)."""
    if m.ffn_dim:
        return int(m.ffn_dim)
    hidden = (8 * m.dim) // 3
    hidden = int(m.ffn_dim_multiplier * hidden)
    return m.multiple_of * math.ceil(hidden / m.multiple_of)


def head_dim(m: Any) -> int:
    return m.dim // m.n_heads


def kv_heads(m: Any) -> int:
    return m.n_kv_heads or m.n_heads


def block_params(m: Any) -> int:
    """One transformer block: q,k,v,o projections, SwiGLU (3 matrices), two RMSNorm weights."""
    h, d = m.dim, head_dim(m)
    attn = 2 * h * (m.n_heads * d) + 2 * h * (kv_heads(m) * d)
    return attn + 3 * h * ffn_dim(m) + 2 * h


def param_count(m: Any) -> int:
    """P = 2*V*h (untied embedding + output) + h (final norm) + L * block."""
    return 2 * m.vocab_size * m.dim + m.dim + m.n_layers * block_params(m)


def human_count(n: float) -> str:
    """8030261248 -> '8.03B', 4689152 -> '4.69M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
