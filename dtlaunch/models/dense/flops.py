"""Training FLOPs per token of the dense decoder (pure Python): MFU, benchmarks and the layout search.

Convention (PaLM appendix B, also torchtitan's): forward + backward = 3x forward, a matmul of an
m-vector by an (m x n) weight costs 2mn per token, so the weights cost 6*N per token where N counts
every parameter that takes part in a matmul (all of them except the input embedding, a lookup; the
untied output head counts). Attention scores and the weighted sum add 2 matmuls of width
n_heads*head_dim against seq_len keys: 2 * 2 * L * (h*q) * s forward, times 3 = 12*L*h*q*s. The
causal mask is *not* discounted (the usual MFU convention; kernels that skip the masked half do less
real work, so MFU stays comparable across implementations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.models.dense.shapes import head_dim, param_count

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


def matmul_params(m: ModelConfig) -> int:
    """Parameters used in matmuls: everything except the input embedding table (a tied head is one)."""
    tied = m.vocab_size * m.dim if getattr(m, "tie_embeddings", False) else 0
    return param_count(m) - m.vocab_size * m.dim + tied


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training (fwd + bwd) FLOPs per token at sequence length seq_len."""
    attention = 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return 6.0 * matmul_params(m) + attention
