"""Bytes per element of the dtype names the schema uses (precision.param_dtype / reduce_dtype)."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
