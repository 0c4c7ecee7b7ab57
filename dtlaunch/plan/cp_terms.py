"""Context parallel's attention exchange in the memory plan: ring attention's (plan/ring_terms.py) or
Ulysses' (plan/ulysses_terms.py), as strategy.cp_style picks. `c` is a stage's shape (plan/shape.py)."""

from __future__ import annotations

from typing import Any

from dtlaunch.config.schema import CpStyle
from dtlaunch.plan import ring_terms, ulysses_terms


def _ulysses(c: Any) -> bool:
    return c.cfg.strategy.cp_style == CpStyle.ulysses


def backward_exchange_bytes(c: Any) -> float:
    """The exchange buffers alive inside one attention's backward."""
    if _ulysses(c):
        return ulysses_terms.backward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, c.cp, c.tokens)
    return ring_terms.backward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, ring_terms.sequence_tokens(c))


def forward_exchange_bytes(c: Any) -> float:
    """The exchange buffers alive inside one attention's forward (a no-grad reference's too)."""
    if _ulysses(c):
        return ulysses_terms.forward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, c.cp, c.tokens)
    return ring_terms.forward_exchange_bytes(c.block_dims, c.compute_bytes, c.tp, ring_terms.sequence_tokens(c))
