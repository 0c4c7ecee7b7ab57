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

Decoding (a cache passed) caches what DeepSeek's inference caches: per position the kv_norm'ed latent
(kv_lora_rank) and the rotated shared key (qk_rope_head_dim), 512 + 64 = 576 values per layer for
DeepSeek-V3 where the per-head keys and values would be 128 x (192 + 128) = 40,960. They sit in the cache's
`k` as one pseudo-head (B, S, 1, kv_lora_rank + qk_rope_head_dim), its `v` zero-wide, so every cache class
(dtlaunch.infer.batch_generate's preallocated and static caches, their row selection, shared-prefix
placement and dropped rows) holds them unchanged. The prefill (an empty cache) attends per head over its
own positions, as training does (the fused kernels, no (heads x S x S) mask); the cache keeps their latent.
A decode step (positions cached already) attends by weight absorption (DeepSeek's own, `_absorbed`): wkv_b's
key half maps each head's no-RoPE query into the latent space, so a head's score is (absorbed query |
rotated query) . (latent | rotated key): one key head, whose values are the keys' latent part, for every
query head; wkv_b's value half maps each head's output back. Chosen over expanding the cached latents
through wkv_b at every step, whose work and transient memory grow with rows x positions x heads: the same
sums in another order, within 1e-5 of the per-head path in fp32 (tests/unit/test_batch_generate.py,
tests/unit/test_deepseek_v3.py). wkv_b's matrix is read by running wkv_b on the identity, so whatever wraps
the linear (LoRA's adapters, tensor parallel's shard of heads, a quantised base) is what gets absorbed, LoRA's
dropout skipped (dtlaunch.models.lora.effective_matrix): once per generation, at the prefill, kept on the
block's cache (`KVCache.derived`) for every decode step; DeepSeek-V3: kv_rank x heads x (nope + v) = 512 x
128 x 256 values per layer (32 MiB in bf16, divided by tp), held while the generation runs.
`latent_cache = False` decodes with the full per-head keys and values instead (the dense decoder's
cache), the reference the tests compare with. Training (no cache) runs as before.

Tensor parallel (tp_plan.py) splits the heads: wq / wq_b and wkv_b column-parallel, wo row-parallel; wq_a,
wkv_a and the latent norms stay whole on every rank. This module knows nothing of torch.distributed: it
reads its head count from its (local) weights' shapes. The one rotated key every head shares passes
through `shared_key`, where tensor parallel sums its gradient over the ranks (each holds some heads).
The latent cache is the same on every TP rank (wkv_a and kv_norm are whole), each rank absorbing its own
heads' share of wkv_b. Context parallel is refused for it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtlaunch.models.deepseek_v3.shapes import softmax_mscale
from dtlaunch.models.dense.documents import Documents
from dtlaunch.models.dense.model import Attention, KVCache, apply_partial_rope, apply_rope, padded_keys, sdpa
from dtlaunch.models.dense.norm import RMSNorm
from dtlaunch.models.lora import effective_matrix

# Hugging Face's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    # Every block attends to the whole causal prefix (the dense attention's mask helper reads this).
    sliding_window: Optional[int] = None
    _mask = Attention._mask
    # Decoding caches the latent and the rotated key (False: the per-head keys and values, as a reference).
    latent_cache = True

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
        latent = self.kv_norm(latent)
        if cache is not None and self.latent_cache and cache.k is not None:
            # A decode step (positions cached already): attention absorbed into the latent space.
            k_rot = self.shared_key(k_rot.view(b, s, 1, self.rope_dim))
            return self._absorbed(q_nope, q_rot, latent, k_rot, cos, sin, mask, cache)
        kv = self.wkv_b(latent).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = self.shared_key(k_rot.view(b, s, 1, self.rope_dim))
        if cache is not None and self.latent_cache:
            # The prefill (nothing cached yet): attention per head over its own positions, as in training;
            # the cache keeps their latent and rotated shared key (any head's rotated part of k).
            q, k = self._heads(q_nope, q_rot, k_nope, k_rot, cos, sin)
            self._store(cache, latent, k[:, :, :1, self.nope :])
            self._absorbed_matrix(cache, latent)  # computed here, eagerly: the decode steps (compiled too) read it
            mask = self._mask(mask, 0, s, s, x.device)
            if cache.key_mask is not None:
                mask = padded_keys(mask, cache.key_mask[:, :s], 0, s)
        elif cache is not None and cache.static:
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

    def _store(
        self, cache: KVCache, latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Cache the new positions' normalised latent (B, S, kv_rank) and rotated shared key (B, S, 1, rope)
        as one key head (latent | rotated key), the values zero-wide. Returns every cached key (B, T, 1,
        kv_rank + rope) and, from a static cache, the attention mask."""
        keys = torch.cat((latent.unsqueeze(2), k_rot), dim=-1)
        no_values = keys.new_empty((*keys.shape[:3], 0))
        if cache.static:
            keys, _, mask = cache.update(keys, no_values, None)
            return keys, mask
        return cache.append(keys, no_values)[0], None

    def _absorbed_matrix(self, cache: KVCache, latent: torch.Tensor) -> torch.Tensor:
        """wkv_b's matrix (kv_rank, this rank's heads x (nope + v)), once per generation: computed at the first
        use (the prefill) and kept on the cache, which lives for one generation (the weights do not change
        during it), so a decode step does not rerun wkv_b on the identity."""
        w = cache.derived.get("wkv_b")
        if w is None:
            w = cache.derived["wkv_b"] = effective_matrix(self.wkv_b, latent)
        return w

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor | Documents],
        cache: KVCache,
    ) -> torch.Tensor:
        """A decode step against the latent cache: q_nope / q_rot (B, S, H, nope / rope), the normalised
        latent (B, S, kv_rank), the shared key (B, S, 1, rope) before RoPE (module docstring)."""
        b, s, heads = q_nope.shape[:3]
        r = self.kv_rank
        if cache.static:
            q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
            keys, mask = self._store(cache, latent, k_rot)
        else:
            start = cache.length
            if cos.dim() == 2:  # shared tables: the new tokens' positions follow the cache
                cos, sin = cos[start:], sin[start:]
            q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
            keys, _ = self._store(cache, latent, k_rot)
            mask = self._mask(mask, start, s, keys.shape[1], q_nope.device)  # start > 0: a causal mask
            if cache.key_mask is not None:
                mask = padded_keys(mask, cache.key_mask[:, : keys.shape[1]], start, s)
        assert isinstance(mask, torch.Tensor), "a decode step attends with an explicit mask"
        w = self._absorbed_matrix(cache, latent).view(r, heads, -1)
        w_k, w_v = w.split([self.nope, self.v_dim], dim=-1)
        # q_nope . (w_k latent) = (q_nope w_k^T) . latent: each head's query in the latent space. The heads
        # fold into the query rows (position, head) of one attention head, the cache's one key head (no
        # copy of the keys per head); the mask's rows repeat per head: one new position's row (a decode
        # step) broadcasts to them, several (sequence parallel's fillers, a shared prefix's own tokens) are
        # copied per head.
        q = torch.cat((torch.einsum("bshn,rhn->bshr", q_nope, w_k), q_rot), dim=-1).reshape(b, 1, s * heads, -1)
        if s > 1:
            mask = mask[..., None, :].expand(*mask.shape[:-1], heads, mask.shape[-1]).flatten(-3, -2)
        keys = keys.transpose(1, 2)  # (B, 1, T, kv_rank + rope): the values are its first kv_rank dims
        # The per-head attention's scale: 1/sqrt(nope + rope), YaRN's mscale^2 on it. Not attention_fn:
        # context parallel, which swaps that, is refused for this attention.
        scale = self.q_scale / math.sqrt(self.nope + self.rope_dim)
        out = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask, scale=scale)
        out = torch.einsum("bshr,rhv->bshv", out[..., :r].reshape(b, s, heads, r), w_v)
        return self.wo(out.reshape(b, s, -1))

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
