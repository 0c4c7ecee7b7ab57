"""Model size questions asked by commands and the planner, answered by the model's registry entry."""

from __future__ import annotations

from typing import Any


def param_count(m: Any) -> int:
    """Exact parameter count of the model section `m` (no torch: closed form from its entry)."""
    from dtlaunch.models.registry import model_spec

    return int(model_spec(m).param_count(m))


def human_count(n: float) -> str:
    """8030261248 -> '8.03B', 4689152 -> '4.69M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
