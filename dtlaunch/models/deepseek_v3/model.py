"""The deepseek_v3 decoder: the MoE decoder (dtlaunch/models/moe/model.py: dense first blocks, routed and
shared experts, the sigmoid router with its correction bias and groups) whose blocks attend with
multi-head latent attention (mla.py) under the same name `attention`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from dtlaunch.models.deepseek_v3.mla import MLAttention
from dtlaunch.models.moe.model import MoEDecoder


class DeepseekV3Decoder(MoEDecoder):
    def make_block(self, m: Any, layer: int) -> nn.Module:
        block = super().make_block(m, layer)
        block.attention = MLAttention(m)
        return block


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> DeepseekV3Decoder:
    with torch.device(device):
        return DeepseekV3Decoder(m, rope_len)
