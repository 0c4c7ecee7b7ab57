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
    def make_attention(self, m: Any, layer: int) -> nn.Module:
        return MLAttention(m)


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> DeepseekV3Decoder:
    with torch.device(device):
        return DeepseekV3Decoder(m, rope_len)
