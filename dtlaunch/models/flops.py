"""Training FLOPs per token (from the model's registry entry) and model FLOPs utilisation."""

from __future__ import annotations

from typing import Any


def flops_per_token(m: Any, seq_len: int) -> float:
    """Training (fwd + bwd) FLOPs per token at sequence length seq_len."""
    from dtlaunch.models.registry import model_spec

    return float(model_spec(m).flops_per_token(m, seq_len))


def matmul_params(m: Any) -> int:
    """Parameters taking part in matmuls (all but the input embedding lookup)."""
    from dtlaunch.models.registry import model_spec

    return int(model_spec(m).matmul_params(m))


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops_per_device: float, n_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the hardware peak is unknown (e.g. CPU)."""
    if peak_tflops_per_device <= 0 or n_devices <= 0:
        return None
    return tokens_per_s * flops_per_tok / (peak_tflops_per_device * 1e12 * n_devices)
