"""The Qwen3.5 decoders: Qwen3-Next's hybrid blocks (Gated DeltaNet in the linear blocks, the dense
decoder's gated full attention with partial RoPE in the others: dtlaunch/models/qwen3_next/model.py) with
Qwen3.5's split Gated DeltaNet input projections, over the dense decoder (qwen3_5: a SwiGLU MLP per block)
or over Qwen3-Next's MoE decoder (qwen3_5_moe: routed experts and the gated shared expert)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from dtlaunch.models.dense.model import Decoder
from dtlaunch.models.qwen3_next.model import GatedDeltaNetBlocks, Qwen3NextDecoder


class Qwen3_5Decoder(GatedDeltaNetBlocks, Decoder):
    split_projections = True


class Qwen3_5MoeDecoder(Qwen3NextDecoder):
    split_projections = True


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> Qwen3_5Decoder:
    with torch.device(device):
        return Qwen3_5Decoder(m, rope_len)


def build_moe_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> Qwen3_5MoeDecoder:
    with torch.device(device):
        return Qwen3_5MoeDecoder(m, rope_len)
