"""Training FLOPs per token for our Llama (pure Python): MFU, benchmarks and the layout search.

Convention (PaLM appendix B, also torchtitan's): forward + backward = 3x forward, a matmul of an
m-vector by an (m x n) weight costs 2mn per token, so the weights cost 6*N per token where N counts
every parameter that takes part in a matmul (all of them except the input embedding, a lookup; the
untied output head counts). Attention scores and the weighted sum add 2 matmuls of width
n_heads*head_dim against seq_len keys: 2 * 2 * L * (h*q) * s forward, times 3 = 12*L*h*q*s. The
causal mask is *not* discounted (the usual MFU convention; kernels that skip the masked half do less
real work, so MFU stays comparable across implementations).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.shapes import head_dim, param_count


def matmul_params(m: Any) -> int:
    """Parameters used in matmuls: everything except the input embedding table."""
    return param_count(m) - m.vocab_size * m.dim


def flops_per_token(m: Any, seq_len: int) -> float:
    """Training (fwd + bwd) FLOPs per token at sequence length seq_len."""
    attention = 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return 6.0 * matmul_params(m) + attention


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops_per_device: float, n_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the hardware peak is unknown (e.g. CPU)."""
    if peak_tflops_per_device <= 0 or n_devices <= 0:
        return None
    return tokens_per_s * flops_per_tok / (peak_tflops_per_device * 1e12 * n_devices)
