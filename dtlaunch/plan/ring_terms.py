"""Context parallel's ring-attention exchange in the memory plan (dtlaunch.train.parallel.context_parallel).

Each attention gathers the whole sequence's K and V from the CP ranks and repeats them to the query
heads; the gathered copies are transient, one block at a time (backward gathers them again instead of
keeping them). "The whole sequence" is every row of this rank's micro-batch at full length: a preference
pair is two rows (dtlaunch.config.decisions.Decisions.rows_per_sample), so it is the stage's tokens times cp.
"""

from __future__ import annotations

from typing import Any


def sequence_tokens(c: Any) -> int:
    """Tokens of this rank's micro-batch rows at full sequence length (what one exchange gathers)."""
    return c.tokens * c.cp


def backward_exchange_bytes(d: Any, e: int, tp: int, tokens: int) -> float:
    """Inside one attention's backward: the gathered K and V (repeated to the query heads) and their fp32
    gradients before the reduce-scatter back; the forward's gathered copies are gone by then."""
    return 2 * (e + 4) * d.qw / tp * tokens


def forward_exchange_bytes(d: Any, e: int, tp: int, tokens: int) -> float:
    """Inside one attention's forward: the gathered K and V repeated to the query heads (no gradients)."""
    return 2 * e * d.qw / tp * tokens
