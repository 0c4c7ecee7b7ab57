"""Context parallel's attention exchange in the memory plan: ring attention's (plan/ring_terms.py) or
Ulysses' (plan/ulysses_terms.py), as strategy.cp_style picks. `c` is a stage's shape (plan/shape.py).
A family whose recurrent blocks take Ulysses' head exchange too (registry `ulysses_blocks`: the Gated DeltaNet
hybrids) gives their buffers as its activation model's `ulysses_block_exchange_bytes`: the larger of the two
counts (one block's exchange at a time)."""

from __future__ import annotations

from typing import Any

from dtlaunch.config.schema import CpStyle
from dtlaunch.plan import ring_terms, ulysses_terms


def _ulysses(c: Any) -> bool:
    return c.cfg.strategy.cp_style == CpStyle.ulysses


def _ulysses_bytes(c: Any, attention: float, backward: bool) -> float:
    """`attention`'s exchange, or a recurrent block's where the family has them and it is larger."""
    blocks = getattr(c.activation_model, "ulysses_block_exchange_bytes", None)
    if blocks is None:
        return attention
    d = c.block_dims
    attention = attention if getattr(d, "linear", 0.0) < 1 else 0.0
    return max(attention, blocks(d, c.compute_bytes, c.tp, c.tokens, backward))


def backward_exchange_bytes(c: Any) -> float:
    """The exchange buffers alive inside one attention's backward."""
    if _ulysses(c):
        attention = ulysses_terms.backward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, c.cp, c.tokens)
        return _ulysses_bytes(c, attention, backward=True)
    return ring_terms.backward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, ring_terms.sequence_tokens(c))


def forward_exchange_bytes(c: Any) -> float:
    """The exchange buffers alive inside one attention's forward (a no-grad reference's too)."""
    if _ulysses(c):
        attention = ulysses_terms.forward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, c.cp, c.tokens)
        return _ulysses_bytes(c, attention, backward=False)
    return ring_terms.forward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, ring_terms.sequence_tokens(c))
