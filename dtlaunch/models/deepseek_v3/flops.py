"""Training FLOPs per token of the deepseek_v3 decoder: the MoE decoder's convention (6 x active matmul
parameters, dtlaunch/models/moe/flops.py) with the latent attention's widths: scores over
qk_nope_head_dim + qk_rope_head_dim dims, the weighted sum over v_head_dim, 2·2·s per dim forward, x3."""

from __future__ import annotations

from typing import Any

from dtlaunch.models.deepseek_v3.shapes import active_layer_params, qk_head_dim


def matmul_params(m: Any) -> int:
    """Active parameters in matmuls: blocks' active weights + the output head (not the embedding lookup)."""
    blocks = sum(active_layer_params(m, i) for i in range(int(m.n_layers)))
    return blocks + int(m.vocab_size) * int(m.dim) + int(m.dim)


def flops_per_token(m: Any, seq_len: int) -> float:
    attention = 6 * int(m.n_layers) * int(m.n_heads) * (qk_head_dim(m) + int(m.v_head_dim)) * seq_len
    return 6.0 * matmul_params(m) + attention
