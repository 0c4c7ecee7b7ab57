"""Multi-head latent attention (DeepSeek-V2/V3), the attention of the deepseek_v3 decoder's blocks.

Queries: dim -> wq (or the low-rank wq_a -> q_norm -> wq_b) -> per head (qk_nope_head_dim | qk_rope_head_dim).
Keys/values: dim -> wkv_a -> (a kv_lora_rank latent | one rotated key of qk_rope_head_dim shared by every head);
the latent -> kv_norm -> wkv_b -> per head (no-RoPE key | value of v_head_dim). A head's key is (no-RoPE
key, the shared rotated key), its query (no-RoPE part, rotated part). Names follow DeepSeek's reference
(wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo); Hugging Face's are mapped by names.py.

RoPE rotates interleaved pairs (model.rope_interleave, DeepSeek's checkpoints) or halves. Hugging Face
de-interleaves the rotated dims of both q and k; that permutes the terms of q·k, not its value, so the
checkpoint's rows are read as they are. The softmax scale is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
(the kernel's own, as the query is that wide).

Decoding caches the full per-head keys and values (the dense decoder's KVCache), not the compressed
latent: simpler, and more memory per cached position than DeepSeek's latent cache.

Tensor parallel (tp_plan.py) splits the heads: wq / wq_b and wkv_b column-parallel, wo row-parallel; wq_a,
wkv_a and the latent norms stay whole on every rank. This module knows nothing of torch.distributed: it
reads its head count from its (local) weights' shapes. The one rotated key every head shares passes
through `shared_key`, where tensor parallel sums its gradient over the ranks (each holds some heads).
Context parallel is refused for it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtlaunch.models.deepseek_v3.shapes import softmax_mscale
from dtlaunch.models.dense.documents import Documents
from dtlaunch.models.dense.model import Attention, KVCache, apply_partial_rope, apply_rope, padded_keys, sdpa
from dtlaunch.models.dense.norm import RMSNorm

# Hugging Face's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    # Every block attends to the whole causal prefix (the dense attention's mask helper reads this).
    sliding_window: Optional[int] = None
    _mask = Attention._mask

    def __init__(self, m: Any) -> None:
        super().__init__()
        heads, dim = int(m.n_heads), int(m.dim)
        self.nope, self.rope_dim, self.v_dim = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
        self.kv_rank = int(m.kv_lora_rank)
        qk = self.nope + self.rope_dim
        bias = bool(getattr(m, "qkv_bias", False))  # Hugging Face's attention_bias: q_a, kv_a and o
        self.wq: Optional[nn.Linear] = None
        self.wq_a: Optional[nn.Linear] = None
        self.q_norm: Optional[RMSNorm] = None
        self.wq_b: Optional[nn.Linear] = None
        if m.q_lora_rank:
            rank = int(m.q_lora_rank)
            self.wq_a = nn.Linear(dim, rank, bias=bias)
            self.q_norm = RMSNorm(rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=bias)
        self.rotate = apply_rope if bool(m.rope_interleave) else apply_partial_rope
        # YaRN's mscale^2 on the softmax scale (1 without YaRN): the kernels divide by sqrt(q width) only.
        self.q_scale = softmax_mscale(m)
        # Identity; under tensor parallel its output's gradient is summed over the ranks (tp_plan.py).
        self.shared_key = nn.Identity()
        self.attention_fn: Callable[..., torch.Tensor] = sdpa

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor | Documents] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rot = q.view(b, s, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = self.shared_key(k_rot.view(b, s, 1, self.rope_dim))
        if cache is not None and cache.static:
            q, k = self._heads(q_nope, q_rot, k_nope, k_rot, cos, sin)
            k, v, mask = cache.update(k, v, None)
        else:
            start = cache.length if cache is not None else 0
            if cos.dim() == 2 and start:  # shared tables: the new tokens' positions follow the cache
                cos, sin = cos[start:], sin[start:]
            q, k = self._heads(q_nope, q_rot, k_nope, k_rot, cos, sin)
            if cache is not None:
                k, v = cache.append(k, v)
            mask = self._mask(mask, start, s, k.shape[1], x.device)
            if cache is not None and cache.key_mask is not None:
                mask = padded_keys(mask, cache.key_mask[:, : k.shape[1]], start, s)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        width = q.shape[-1]
        if self.v_dim != width:
            # Values padded with zeros to the q/k width, the output cut back: the fused kernels (CPU's
            # flash, CUDA's flash) take one head width; with two, SDPA falls back to the math kernel,
            # which keeps the (S x S) probabilities for backward.
            v = F.pad(v, (0, width - self.v_dim))
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2)[..., : self.v_dim].reshape(b, s, -1))

    def _heads(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        k_nope: torch.Tensor,
        k_rot: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, H, nope + rope) queries and keys: the rotated parts after the no-RoPE ones, the one
        rotated key repeated for every head."""
        q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        return q, k
