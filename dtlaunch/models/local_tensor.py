"""A parameter's local part when a parallel layout made it a DTensor: the one place model code sees one.

Modules that compute on plain tensors (the routed experts behind their dispatch hooks, the sink attention's
per-head logits) take their weights' local shard; a plain parameter is returned as it is.
"""

from __future__ import annotations

import torch


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p
