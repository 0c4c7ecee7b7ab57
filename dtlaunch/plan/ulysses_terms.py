"""Ulysses sequence parallel's exchange in the memory plan (dtlaunch.train.parallel.ulysses).

Around each attention an all-to-all sends this rank's tokens of q, k and v (K/V heads repeated up to
config.layout.ulysses_kv_heads where cp does not divide them) to the ranks owning their heads and receives
the whole sequence of its own heads: [tokens × (q heads + 2 × K/V heads) × head_dim] sent and as much
received, `tokens` being this rank's share (the stage's micro-batch rows over the local sequence). The
attention output goes back the same way. Unlike ring attention's gathered K/V (whole-sequence sized), every
buffer is one rank's share, so it does not grow with cp. The head shards the kernel saves for backward are
as large as the local q, k, v that plain attention saves, which they replace (with repeated K/V heads the
kernel saves the repeated copies: counted here per attention, not per kept layer).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.config.layout import ulysses_kv_heads


def qkv_width(q_heads: int, kv_heads: int, head_dim: int, tp: int, cp: int) -> float:
    """Elements per token of one rank's q, k and v as the all-to-all carries them (per tensor-parallel rank)."""
    return (q_heads // tp + 2 * ulysses_kv_heads(max(1, kv_heads // tp), cp)) * head_dim


def exchanged_width(d: Any, tp: int, cp: int) -> float:
    """qkv_width of a block's dimensions (models.dense.activations.BlockDims)."""
    return qkv_width(d.qw // d.head, d.k // d.head, d.head, tp, cp)


def forward_exchange_bytes(d: Any, e: int, tp: int, cp: int, tokens: int) -> float:
    """Inside one attention's forward: q, k, v's send buffers and the received head shards (the output's
    exchange, q-sized, comes after they are freed)."""
    return 2 * e * exchanged_width(d, tp, cp) * tokens


def backward_exchange_bytes(d: Any, e: int, tp: int, cp: int, tokens: int) -> float:
    """Inside one attention's backward: the kernel's q, k, v gradients on the head shards, their send
    buffers and what comes back (the output gradient's exchange, q-sized, is done by then)."""
    return 3 * e * exchanged_width(d, tp, cp) * tokens
