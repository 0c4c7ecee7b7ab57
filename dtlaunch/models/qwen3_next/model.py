"""The qwen3_next decoder: the MoE decoder (dtlaunch/models/moe/model.py: routed experts, the shared expert
and its gate, Qwen's sparse-step rule) whose blocks mix tokens with Gated DeltaNet (gated_deltanet.py) or,
every fourth block by default, with the dense decoder's attention (its output gate, per-head (1 + gain) q/k
norms and partial RoPE set by the model section), both under the name `attention`.

`GatedDeltaNetBlocks` is that hybrid part alone, over any decoder: Qwen3.5 (dtlaunch/models/qwen3_5/) puts
it over the dense decoder and over this one, with its split input projections."""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
from torch import nn

from dtlaunch.models.dense.model import KVCache
from dtlaunch.models.moe.model import MoEDecoder
from dtlaunch.models.qwen3_next.config import GatedDeltaNetModelConfig, layer_kinds
from dtlaunch.models.qwen3_next.gated_deltanet import GatedDeltaNet, RecurrentState, initial_value


class GatedDeltaNetBlocks:
    """Mixed into a decoder (before it in the bases): Gated DeltaNet in the linear blocks."""

    # Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; False: Qwen3-Next's fused two.
    split_projections = False
    cfg: GatedDeltaNetModelConfig  # the decoder's model section

    def make_attention(self, m: Any, layer: int) -> Optional[nn.Module]:
        if layer_kinds(m)[layer] == "linear_attention":
            return GatedDeltaNet(m, split_projections=self.split_projections)
        return None

    def decoding_cache(self, layer: str, kv: KVCache) -> KVCache:
        """A linear block decodes with its recurrent state (reading the caller's padding mask), not keys."""
        return RecurrentState(kv.key_mask) if layer_kinds(self.cfg)[int(layer)] == "linear_attention" else kv

    def init_param(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The Gated DeltaNet's own parameters as Qwen3-Next initialises them (its gated norm's gain is a
        plain one, not the (1 + gain) of the other norms); the rest as the decoder under it."""
        if ".attention." in name:
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            value = initial_value(name, shape, g)
            if value is not None:
                return value
        return super().init_param(name, shape, seed)  # type: ignore[misc]


class Qwen3NextDecoder(GatedDeltaNetBlocks, MoEDecoder):
    pass


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> Qwen3NextDecoder:
    with torch.device(device):
        return Qwen3NextDecoder(m, rope_len)
