"""gpt-oss's published MXFP4 experts (openai/gpt-oss-*: `gate_up_proj_blocks` / `_scales`, `down_proj_blocks`
/ `_scales`): dequantized on import by transformers' own helper, to the layout of the unquantized tensors
([experts, in, out]). Training then runs on the dequantized weights; export writes them unquantized."""

from __future__ import annotations

from typing import Any

from dtlaunch.errors import InputError

BLOCKS, SCALES = "_blocks", "_scales"


def dequantized(blocks: Any, scales: Any) -> Any:
    """[E, out, groups, 16] uint8 blocks (two FP4 values a byte) and [E, out, groups] uint8 exponents -> fp32
    [E, groups * 32, out]. On the meta device (the importer's shape check) only the shape is computed."""
    import torch

    e, out, groups, width = blocks.shape
    if blocks.is_meta:
        return torch.empty(e, groups * width * 2, out, device="meta")
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as exc:
        raise InputError(
            f"MXFP4 expert weights are dequantized by transformers' convert_moe_packed_tensors, which does not "
            f"import here ({exc}): pip install 'dtlaunch[hf]', or point model.init_from at a bf16 copy"
        ) from None
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
