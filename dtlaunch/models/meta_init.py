"""Building a model on the meta device without paying for random init it cannot have.

A meta tensor has no data, so filling it in place is a no-op; yet torch routes `Tensor.normal_` on meta
through its Python reference, whose first call imports torch._dynamo: about a second of every worker's
start (nn.Embedding's reset_parameters alone triggers it), and of every launcher-side check that builds
a model to read its shapes. Every parameter built on meta is initialised later by its own rule (the
runtime's seeded `init_param`, or weights loaded from a checkpoint), so the fill is skipped there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class SkipRandomInitOnMeta(TorchFunctionMode):
    """In-place random fills of meta tensors return the tensor untouched; everything else runs as is."""

    # Fills whose meta path is that Python reference (uniform_ has a meta kernel and costs nothing). The
    # nn.init entry points are listed too: under a mode they arrive whole, and the Tensor method they
    # call inside is not seen again.
    _FILLS = frozenset(
        {torch.Tensor.normal_, torch.nn.init.normal_, torch.nn.init.kaiming_normal_, torch.nn.init.xavier_normal_}
    )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)
