"""The dtype names the schema uses (precision.param_dtype / reduce_dtype, a peft record's base_dtype): their
bytes per element, and the torch dtype each names."""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def torch_dtype(name: Any) -> Any:
    """The torch dtype of a schema dtype name."""
    import torch  # here, not at the top: the planner reads DTYPE_BYTES without loading torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[str(name)]
