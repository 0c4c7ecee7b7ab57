"""The MoE decoder behind the qwen3_moe, mixtral, glm4_moe, gpt_oss and moe registry entries: the dense decoder
(dtlaunch/models/dense/model.py: embedding, RoPE, attention, norms, head) whose sparse blocks have a
mixture of experts (dtlaunch/models/moe/layer.py) in place of the SwiGLU, under the same name
`feed_forward`, so the block's forward and the pipeline split are the dense ones.

Parameter names: layers.N.feed_forward.router.gate.weight (and .bias: gpt-oss),
layers.N.feed_forward.experts.{w1,w2,w3} (3-D, expert first; biases b1, b2, b3: gpt-oss) and
layers.N.feed_forward.shared_experts.{w1,w2,w3}.weight.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
from torch import nn

from dtlaunch.models.dense.model import Decoder, TransformerBlock
from dtlaunch.models.moe.layer import MoE
from dtlaunch.models.moe.shapes import expert_dim, is_sparse, shared_dim, sparse_layers


def build_moe_layer(m: Any) -> MoE:
    moe = m.moe
    n_sparse = max(1, len(sparse_layers(m)))
    return MoE(
        dim=m.dim,
        hidden=expert_dim(m),
        num_experts=int(moe.num_experts),
        top_k=int(moe.top_k),
        num_shared=int(moe.num_shared_experts),
        shared_hidden=shared_dim(m),
        score_func=str(moe.score_func),
        norm_topk=bool(moe.norm_topk),
        # The total aux loss is the mean over the sparse blocks, times the coefficient.
        aux_loss_coef=float(moe.aux_loss_coef) / n_sparse,
        expert_bias=float(moe.bias_update_rate) > 0 or str(moe.score_func) == "sigmoid_bias",
        n_group=int(moe.n_group),
        topk_group=int(moe.topk_group),
        routed_scaling=float(moe.routed_scaling),
        # gpt-oss (dtlaunch/models/gpt_oss/config.py): router logit bias, expert biases, clamped SwiGLU.
        gate_bias=bool(getattr(m, "router_bias", False)),
        expert_linear_bias=bool(getattr(m, "expert_biases", False)),
        swiglu_clamp=swiglu_clamp(m),
        # Qwen3-Next, Qwen3.5-MoE (dtlaunch/models/qwen3_next/config.py): the shared expert's sigmoid gate.
        shared_gate=bool(getattr(m, "shared_expert_gate", False)),
    )


def swiglu_clamp(m: Any) -> Optional[tuple[float, float]]:
    """(alpha, limit) of gpt-oss's clamped SwiGLU when the model section sets swiglu_limit; None: SwiGLU."""
    limit = getattr(m, "swiglu_limit", None)
    return None if limit is None else (float(m.swiglu_alpha), float(limit))


class MoEDecoder(Decoder):
    def make_block(self, m: Any, layer: int) -> nn.Module:
        block = TransformerBlock(m, layer, self.make_attention(m, layer))
        if is_sparse(m, layer):
            block.feed_forward = build_moe_layer(m)
        return block

    def buffer_values(self, device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
        """RoPE tables, and zeros for the routing counters and the expert bias (a resume loads the bias)."""
        n = int(self.cfg.moe.num_experts)
        zeros = torch.zeros(n, device=device)
        return {
            **super().buffer_values(device),
            "tokens_per_expert": zeros,
            "expert_bias": zeros,
            "aux_loss_stats": torch.zeros(2, device=device),
        }

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for name, buf in self.named_buffers():
            for suffix, value in self.buffer_values(buf.device).items():
                if name.endswith(suffix) and "rope" not in suffix:
                    buf.copy_(value)

    def init_param(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """As the dense decoder; the routed experts' down projections are residual outputs (scaled by depth)."""
        if name.endswith(("experts.b1", "experts.b2", "experts.b3")):
            return torch.zeros(shape)  # gpt-oss's expert biases start at zero, as every bias here
        if name.endswith("experts.w2"):
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            return torch.randn(shape, generator=g).mul_(0.02 / math.sqrt(2 * self.cfg.n_layers))
        return super().init_param(name, shape, seed)


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> MoEDecoder:
    with torch.device(device):
        return MoEDecoder(m, rope_len)
