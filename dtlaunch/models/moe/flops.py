"""Training FLOPs per token of the MoE decoder: the dense convention (6 x matmul parameters + attention,
see dtlaunch/models/dense/flops.py) with only the *active* parameters: a token multiplies its top-k
routed experts, the router and the shared experts, never the other experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.models.moe.shapes import active_layer_params, head_dim

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


def matmul_params(m: ModelConfig) -> int:
    """Active parameters in matmuls: blocks' active weights + the output head (not the embedding lookup)."""
    blocks = sum(active_layer_params(m, i) for i in range(int(m.n_layers)))
    return blocks + m.vocab_size * m.dim + m.dim


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    attention = 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return 6.0 * matmul_params(m) + attention
