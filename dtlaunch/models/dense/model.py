"""The dense decoder behind the llama, qwen2, qwen3, mistral, smollm3, olmo3 and gemma3 registry entries (and
the MoE entries' attention): RMSNorm, RoPE (with Llama-3.1 or YaRN scaling; partial, over the first dims of each head, for GLM-4.5), GQA attention, SwiGLU; flags from the model section add q/k/v biases
(Qwen2), per-head q/k RMSNorm and a free head_dim (Qwen3), a sliding attention window (Mistral) on every
block or on those `layer_types` names (OLMo 3), layers whose attention has no RoPE (SmolLM3's NoPE
layers), post-norm blocks with a q/k RMSNorm over the whole projection (OLMo 3), a head tied to the
embedding (Llama 3.2 1B/3B, small Qwen, SmolLM3) and Gemma 3's parts: norms before and after each sublayer
(`sandwich_norm`) with (1 + gain) RMSNorm (`norm_offset`), embeddings scaled by sqrt(dim), a GELU-tanh
gated MLP, `query_pre_attn_scalar` as the attention scale and a second RoPE base for the sliding layers
(`rope_local_theta`; the global one with optional linear scaling, `rope_linear_factor`), and gpt-oss's
attention (through the MoE decoder): a learned sink logit per head in each softmax (`attention_sinks`,
`sink_attention`), a bias on the output projection (`attention_out_bias`) and YaRN RoPE (`rope_yarn`).

This module knows nothing of torch.distributed. Parallelism is applied from outside:
- tensor parallel reshapes with the *local* head count (`view(B, S, -1, head_dim)`), so a sharded
  wq/wk/wv just yields fewer heads here;
- pipeline splitting deletes blocks from `layers` (a ModuleDict keyed by the global block index, so
  parameter names stay those of the full model) and sets `tok_embeddings`/`norm`/`output` to None.
Parameter names follow Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...); a family's
Hugging Face names are mapped by its registry entry (dtlaunch/models/<family>/hf.py).
"""

from __future__ import annotations

import copy
import math
import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtlaunch.models.dense.documents import Documents, attend, dense_mask
from dtlaunch.models.dense.norm import RMSNorm
from dtlaunch.models.dense.shapes import SINK_DIMS, ffn_dim, head_dim, kv_heads, rotary_dim
from dtlaunch.models.dense.yarn import attention_factor, yarn_frequencies
from dtlaunch.models.local_tensor import local_tensor

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


def local_rope(m: Any) -> bool:
    """Whether sliding-window blocks rotate with a base of their own (Gemma 3's rope_local_theta)."""
    return getattr(m, "rope_local_theta", None) is not None


def rope_frequencies(m: Any, local: bool = False) -> torch.Tensor:
    """Inverse frequencies per rotary pair, with Llama-3.1's wavelength-dependent scaling, YaRN (gpt-oss,
    `rope_yarn`) or a linear factor (Gemma 3's global layers) if set; `local`: the sliding layers' base, unscaled."""
    d = rotary_dim(m)
    theta = m.rope_local_theta if local else m.rope_theta
    yarn = _yarn(m)
    if yarn is not None:
        return yarn_frequencies(d, float(theta), yarn)
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    linear = getattr(m, "rope_linear_factor", None)
    if linear and not local:
        freqs = freqs / linear
    rs = m.rope_scaling
    if rs is None or local:
        return freqs.float()
    low_wavelen = rs.original_max_seq_len / rs.low_freq_factor
    high_wavelen = rs.original_max_seq_len / rs.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (rs.original_max_seq_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, freqs / rs.factor, freqs)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = torch.where(mid, (1 - smooth) * freqs / rs.factor + smooth * freqs, scaled)
    return scaled.float()


def _yarn(m: Any) -> Any:
    """The model section's YaRN fields: gpt-oss's `rope_yarn`, DeepSeek-V3's `yarn`; None without YaRN."""
    yarn = getattr(m, "rope_yarn", None)
    return yarn if yarn is not None else getattr(m, "yarn", None)


def rope_attention_factor(m: Any) -> float:
    """YaRN's scale on cos and sin (so on q·k twice); 1 without YaRN (dtlaunch.models.dense.yarn)."""
    yarn = _yarn(m)
    return 1.0 if yarn is None else attention_factor(yarn)


def rope_cache(m: Any, seq_len: int, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin per (position, rotary pair). With a local base (Gemma 3) each row holds the global
    tables then the local ones, (seq_len, head_dim): one pair of tables still reaches every block (what
    sequence parallel, pipeline stages and decoding pass along) and each block takes its half."""
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type == "meta":
        # A meta build holds shapes only (buffer_values fills the tables once materialised); computing
        # them on meta runs torch's Python references, whose first call imports torch._dynamo (~1 s).
        shape = (seq_len, rotary_dim(m) // 2 * (2 if local_rope(m) else 1))
        return torch.empty(shape, device=target), torch.empty(shape, device=target)
    freqs = rope_frequencies(m).to(device)
    if local_rope(m):
        freqs = torch.cat([freqs, rope_frequencies(m, local=True).to(device)])
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    scale = rope_attention_factor(m)
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def _tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin broadcast to x (B, S, H, D) in x's dtype: (S, D/2) shared tables, or (B, S, D/2) per sequence."""
    # Buffers stay fp32 (FSDP mixed precision does not cast them): compute in x's dtype.
    if cos.dim() == 3:
        return cos.type_as(x)[:, :, None, :], sin.type_as(x)[:, :, None, :]
    return cos[: x.shape[1]].type_as(x)[None, :, None, :], sin[: x.shape[1]].type_as(x)[None, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (Meta's layout). x: (B, S, H, D); cos/sin: (S, D/2), or (B, S, D/2) when
    every sequence has its own positions (packed documents)."""
    cos, sin = _tables(x, cos, sin)
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial RoPE (GLM-4.5): the first 2 x cos.shape[-1] dims of each head rotate, pairs (i, i + r/2) as
    Hugging Face lays them out, the others pass through. Rotating in Hugging Face's layout leaves the
    checkpoint's rows unpermuted (a permutation of the rotated part only would be one more layout)."""
    half = cos.shape[-1]
    cos, sin = _tables(x, cos, sin)
    x0, x1, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin, rest), dim=-1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor | Documents]) -> torch.Tensor:
    """Causal attention (or `mask`'s, True = may attend; packed `Documents`: causal inside each) with
    grouped-query heads: torch's SDPA."""
    if isinstance(mask, Documents):
        return attend(q, k, v, mask)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor | Documents], sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink) per head (gpt-oss; transformers' eager
    gpt_oss attention), through SDPA's fused kernels (no (S x T) matrix): one key is prepended whose score
    is the head's sink and whose value is zero. A key cannot carry a per-query-head score under GQA, so
    the sink rides in an extra query dim (q' = [q, sink, 0...], every real key 0 there, the sink key
    sqrt(head_dim) there: q'·k_sink / sqrt(head_dim) = sink). A dummy query row is prepended too, so plain
    causal attention (query i+1 sees keys 0..i+1: the sink and real keys 0..i) needs no mask; a given mask
    gains a row and a column that may attend. q (B, H, S, D), k and v (B, KV, T, D); `mask` as `sdpa`'s."""
    if isinstance(mask, Documents):
        raise ValueError("sink_attention takes a dense mask: the decoder builds one for packed documents")
    b, h, s, d = q.shape
    kv, t = k.shape[1], k.shape[2]
    pad = SINK_DIMS
    sink_col = sinks.to(q.dtype).reshape(1, h, 1, 1).expand(b, h, s, 1)
    q2 = torch.cat([q, sink_col, q.new_zeros(b, h, s, pad - 1)], dim=-1)
    q2 = torch.cat([q2.new_zeros(b, h, 1, d + pad), q2], dim=2)
    sink_key = k.new_zeros(b, kv, 1, d + pad)
    sink_key[..., d] = d**0.5
    k2 = torch.cat([sink_key, torch.cat([k, k.new_zeros(b, kv, t, pad)], dim=-1)], dim=2)
    v2 = torch.cat([v.new_zeros(b, kv, 1, d + pad), torch.cat([v, v.new_zeros(b, kv, t, pad)], dim=-1)], dim=2)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], s, t) if mask.dim() > 2 else mask
        lead = mask.shape[:-2]
        mask = torch.cat([mask.new_ones(*lead, s, 1), mask], dim=-1)
        mask = torch.cat([mask.new_ones(*lead, 1, t + 1), mask], dim=-2)
    out = F.scaled_dot_product_attention(
        q2, k2, v2, attn_mask=mask, is_causal=mask is None, scale=d**-0.5, enable_gqa=h != kv
    )
    return out[:, :, 1:, :d]


def uses_rope(m: Any, layer: Optional[int]) -> bool:
    """Whether block `layer` rotates q and k (SmolLM3's `no_rope_layers` attend by content alone)."""
    return layer is None or layer not in set(getattr(m, "no_rope_layers", None) or ())


def layer_window(m: Any, layer: Optional[int]) -> Optional[int]:
    """Block `layer`'s attention window: `model.sliding_window`, unless `model.layer_types` (one entry per
    block, OLMo 3's interleaving) says this block attends fully ("full_attention")."""
    window = getattr(m, "sliding_window", None) or None
    kinds = getattr(m, "layer_types", None) or ()
    if window is not None and layer is not None and kinds and kinds[layer] == "full_attention":
        return None
    return window


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, rope: bool = True, layer: Optional[int] = None) -> None:
        super().__init__()
        self.head_dim = head_dim(m)
        # Gemma: softmax(q·k / sqrt(query_pre_attn_scalar)). Every attention kernel here (SDPA, packed
        # documents, ring, Ulysses) divides by sqrt(head_dim), so q is scaled by the ratio first (1: no op).
        scalar = getattr(m, "query_pre_attn_scalar", None)
        self.q_scale = 1.0 if not scalar or float(scalar) == self.head_dim else math.sqrt(self.head_dim / scalar)
        # False: a NoPE layer. It still receives the shared cos/sin tables (the block's inputs stay the
        # same for every layer, which tensor/sequence parallel and pipeline stages rely on) and ignores them.
        self.rope = rope
        # Partial RoPE (rotary_dim < head_dim) rotates in Hugging Face's layout (apply_partial_rope).
        self.rotate = apply_rope if rotary_dim(m) == self.head_dim else apply_partial_rope
        bias = bool(getattr(m, "qkv_bias", False))
        # Qwen3-Next: q_proj also yields a per-head output gate (each head's rows: head_dim of query, then
        # head_dim of gate, so tensor parallel's head shards keep them together); out *= sigmoid(gate).
        self.output_gate = bool(getattr(m, "attention_output_gate", False))
        self.wq = nn.Linear(m.dim, m.n_heads * self.head_dim * (2 if self.output_gate else 1), bias=bias)
        self.wk = nn.Linear(m.dim, kv_heads(m) * self.head_dim, bias=bias)
        self.wv = nn.Linear(m.dim, kv_heads(m) * self.head_dim, bias=bias)
        self.wo = nn.Linear(m.n_heads * self.head_dim, m.dim, bias=bool(getattr(m, "attention_out_bias", False)))
        # gpt-oss: a learned logit per head in every softmax denominator (sink_attention), in place of attention_fn.
        self.sinks: Optional[nn.Parameter] = (
            nn.Parameter(torch.empty(m.n_heads)) if getattr(m, "attention_sinks", False) else None
        )
        # Parameters with one entry per query head: tensor parallel shards them with the heads.
        self.head_parameters: tuple[str, ...] = ("sinks",) if self.sinks is not None else ()
        # Per-head norms over head_dim, shared by all heads (so tensor parallel replicates them); with
        # qk_norm_whole (OLMo 2/3) one norm over the whole projection, a gain per q (k) feature, whose mean
        # square spans every head (validate refuses tensor parallel for it: a rank holds some heads only).
        self.qk_norm_whole = bool(getattr(m, "qk_norm_whole", False))
        q_width, k_width = (
            (m.n_heads * self.head_dim, kv_heads(m) * self.head_dim) if self.qk_norm_whole else (self.head_dim,) * 2
        )
        offset = float(getattr(m, "norm_offset", 0.0) or 0.0)
        qk = getattr(m, "qk_norm", False)
        self.q_norm: Optional[RMSNorm] = RMSNorm(q_width, m.norm_eps, offset) if qk else None
        self.k_norm: Optional[RMSNorm] = RMSNorm(k_width, m.norm_eps, offset) if qk else None
        self.sliding_window: Optional[int] = layer_window(m, layer)
        # Which columns of the shared RoPE tables this block rotates with: all of them, or with a local
        # base (Gemma 3) the global half, or the local half for a sliding-window block.
        half = rotary_dim(m) // 2
        kinds = getattr(m, "layer_types", None) or ()
        sliding = (
            kinds[layer] == "sliding_attention" if kinds and layer is not None else self.sliding_window is not None
        )
        local = local_rope(m) and sliding
        self.rope_columns: Optional[slice] = (
            None if not local_rope(m) else slice(half, None) if local else slice(0, half)
        )
        # The attention kernel, (q, k, v, mask) -> out on (B, heads, S, head_dim): a seam through which
        # parallelism swaps in another (context parallel's ring attention) without this module knowing.
        self.attention_fn: Callable[..., torch.Tensor] = sdpa

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor | Documents] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """`mask`: packed `Documents` (causal within each), or (B, 1, S, S) boolean, True where a query may
        attend; `cache`: decoding only, the new tokens follow the cached positions."""
        b, s, _ = x.shape
        if self.rope_columns is not None:
            cos, sin = cos[..., self.rope_columns], sin[..., self.rope_columns]
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q, k = self.wq(x), self.wk(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, -1)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is not None and cache.static:
            # A static cache (compiled decoding) knows the positions (the caller passes their RoPE tables)
            # and which keys each new token sees; its shapes never change.
            if self.rope:
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            k, v, mask = cache.update(k, v, self.sliding_window)
        else:
            start = cache.length if cache is not None else 0
            if cos.dim() == 2 and start:  # shared tables: the new tokens' positions follow the cache
                cos, sin = cos[start:], sin[start:]
            if self.rope and cache is not None:  # decoding: q and k rotated in one pass (half the op calls)
                qk = self.rotate(torch.cat((q, k), dim=2), cos, sin)
                q, k = qk[:, :, : q.shape[2]], qk[:, :, q.shape[2] :]
            elif self.rope:
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            if cache is not None:
                k, v = cache.append(k, v)
            if cache is not None and cache.key_mask is not None:
                mask = cache.step_mask(self.sliding_window, lambda: self._padded_mask(mask, start, s, k, cache))
            else:
                mask = self._mask(mask, start, s, k.shape[1], x.device)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.sinks is not None:
            sinks = local_tensor(self.sinks)  # this rank's heads' under tensor parallel
            out = sink_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks)
        else:
            out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out if gate is None else out * torch.sigmoid(gate))

    def _padded_mask(self, doc_mask: Any, start: int, s: int, k: torch.Tensor, cache: KVCache) -> torch.Tensor:
        assert cache.key_mask is not None
        total = k.shape[1]
        return padded_keys(self._mask(doc_mask, start, s, total, k.device), cache.key_mask[:, :total], start, s)

    def _mask(
        self, doc_mask: Optional[torch.Tensor | Documents], start: int, s: int, total: int, device: torch.device
    ) -> Optional[torch.Tensor | Documents]:
        """None for plain causal attention over the whole sequence (SDPA's fast path); else a boolean
        mask: causal from position `start` on (decoding with a cache), within the sliding window, and
        within the document when a document mask is given."""
        window = self.sliding_window
        if start == 0 and (window is None or window >= total):
            return doc_mask
        qpos = torch.arange(start, start + s, device=device)[:, None]
        kpos = torch.arange(total, device=device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        if doc_mask is not None:
            mask = doc_mask & mask  # (B, 1, S, S) with (S, S)
        return mask


def padded_keys(mask: Optional[torch.Tensor], key_mask: torch.Tensor, start: int, s: int) -> torch.Tensor:
    """`mask` (causal from `start`, or None: causal from 0) limited to the real keys of a left-padded batch
    (`key_mask` (B, total), True = a real token). Each query may always see itself, so a padding position's
    row is never empty (an empty row would make SDPA return NaN, which its zero weights would then spread)."""
    total = key_mask.shape[1]
    qpos = torch.arange(start, start + s, device=key_mask.device)[:, None]
    kpos = torch.arange(total, device=key_mask.device)[None, :]
    causal = kpos <= qpos if mask is None else mask
    return (causal & key_mask[:, None, None, :]) | (kpos == qpos)


class KVCache:
    """Keys and values of the positions seen so far, for one block (decoding; never in training).

    `key_mask` (B, positions), when set by the decoder, marks which cached positions are real tokens (a
    left-padded batch of prompts); attention then ignores the others."""

    # True: a fixed-shape cache (dtlaunch.infer.batch_generate.StaticKVCache) whose `update(k, v, window)`
    # writes the new positions and returns (keys, values, the attention mask).
    static = False

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.key_mask: Optional[torch.Tensor] = None
        # Tensors an attention derives from its weights for this cache's generation, computed once (at the
        # prefill) and read by every decode step (DeepSeek-V3's absorbed wkv_b matrix). Per block, not per
        # row: row selection leaves them alone.
        self.derived: dict[str, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])

    def step_mask(self, window: Optional[int], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """This forward's attention mask for a block with sliding `window` (`build` makes it). A decoder
        whose blocks' caches share one memo (dtlaunch.infer.batch_generate) builds it once per forward."""
        return build()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    def select_rows(self, index: torch.Tensor, key_mask: Optional[torch.Tensor]) -> None:
        """Keep the rows `index` (repeats allowed: each prompt's prefill copied to its completions' rows)."""
        assert self.k is not None and self.v is not None
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
        self.key_mask = key_mask


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# model.mlp_activation -> the gate's activation (SwiGLU's SiLU; Gemma's GELU with the tanh approximation).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str = "silu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, m: ModelConfig, layer: Optional[int] = None, attention: Optional[nn.Module] = None) -> None:
        super().__init__()
        # post_norm (OLMo 2/3): the two norms act on the attention and MLP outputs before each residual add,
        # and the sublayers read the residual stream itself (Hugging Face: post_attention_layernorm,
        # post_feedforward_layernorm). Same modules and names either way, so shapes, counts and FSDP units agree.
        self.post_norm = bool(getattr(m, "post_norm", False))
        offset = float(getattr(m, "norm_offset", 0.0) or 0.0)
        self.attention_norm = RMSNorm(m.dim, m.norm_eps, offset)
        # `attention`: a family's own (DeepSeek-V3's latent attention), with this module's forward signature.
        self.attention = attention if attention is not None else Attention(m, rope=uses_rope(m, layer), layer=layer)
        self.ffn_norm = RMSNorm(m.dim, m.norm_eps, offset)
        self.feed_forward = FeedForward(m.dim, ffn_dim(m), getattr(m, "mlp_activation", None) or "silu")
        # sandwich_norm (Gemma 2/3): the pre-norms above plus a norm on each sublayer's output before its
        # residual add (Hugging Face: post_attention_layernorm, post_feedforward_layernorm).
        self.post_attention_norm: Optional[RMSNorm] = None
        self.post_ffn_norm: Optional[RMSNorm] = None
        if getattr(m, "sandwich_norm", False):
            self.post_attention_norm = RMSNorm(m.dim, m.norm_eps, offset)
            self.post_ffn_norm = RMSNorm(m.dim, m.norm_eps, offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        # The cache as a keyword: sequence parallel's input preparation checks the positional inputs
        # (x, cos, sin, mask) and passes keywords through.
        if self.post_norm:
            h = x + self.attention_norm(self.attention(x, cos, sin, mask, cache=cache))
            return h + self.ffn_norm(self.feed_forward(h))
        if self.post_attention_norm is not None:
            h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, mask, cache=cache))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, m: ModelConfig, rope_len: Optional[int] = None) -> None:
        super().__init__()
        self.cfg = m
        self.rope_len = rope_len or m.max_seq_len
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(m, i) for i in range(m.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(m.dim, m.norm_eps, float(getattr(m, "norm_offset", 0.0) or 0.0))
        self.output: Optional[nn.Linear] = nn.Linear(m.dim, m.vocab_size, bias=False)
        if getattr(m, "tie_embeddings", False):
            # One Parameter under two names; named_parameters() (init, FSDP, optimizer) sees it once.
            self.output.weight = self.tok_embeddings.weight
        # Read once: a typed config without the field raises inside getattr, and the traceback of that
        # exception, on every forward, kept the forward's tensors alive until the next garbage collection
        # (GRPO's generation peak grew 21 %: tests/e2e/test_grpo_cli.py::test_plan_of_the_generation_phase).
        self.embed_scale = bool(getattr(m, "embed_scale", False))
        self.attention_sinks = bool(getattr(m, "attention_sinks", False))
        # Gemma's embedding factor sqrt(dim) as the embedding's dtype rounds it, per floating dtype.
        self.embed_factor = {
            dt: float(torch.tensor(m.dim**0.5, device="cpu").to(dt))
            for dt in (torch.float32, torch.bfloat16, torch.float16)
        }
        # The residual stream's dtype when it is not the embedding's (keep_residual_in); None: as computed.
        self.residual_dtype: Optional[torch.dtype] = None
        # Not persistent: derived from the config, so checkpoints carry weights only.
        cos, sin = rope_cache(m, self.rope_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        caches: Optional[list[KVCache]] = None,
        last_only: bool = False,
        head: bool = True,
    ) -> torch.Tensor:
        """tokens (B, S) int64 -> logits (B, S, V); a pipeline middle stage maps hidden -> hidden. `head=False`:
        the final norm's output (B, S, h) instead of the logits, which the trainer's chunked loss projects
        chunk by chunk (training.loss_chunks, dtlaunch.train.loss.HeadLoss.logits), so the full logits never
        exist. `last_only`: the logits of the last position only (decoding's prefill samples from it alone).

        Packed documents: `positions` (B, S) restart RoPE at each document; `doc_ids` (B, S) keep attention
        inside each document (causal and same document). `caches` (one per block, decoding only): the
        new tokens follow the cached positions."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.tok_embeddings is not None and self.embed_scale:
            # Gemma: embeddings times sqrt(dim), that factor rounded to the embedding's dtype first (as
            # transformers' Gemma3TextScaledWordEmbedding), so bf16 weights see the same bf16 product.
            h = h * self.embed_factor[h.dtype]
        if self.residual_dtype is not None and h.is_floating_point():
            h = h.to(self.residual_dtype)
        # One copy of the tables in the hidden state's dtype, shared by every block. Handed the fp32
        # tables, FSDP's mixed-precision hook would cast them again at each block's entry: a copy
        # per block, kept for backward under activation checkpointing.
        dtype = h.dtype if h.is_floating_point() else self.rope_cos.dtype
        cos, sin = self.rope_cos.to(dtype), self.rope_sin.to(dtype)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        mask = None
        if doc_ids is not None:  # packed documents: their lengths, not an [S x S] mask (models.dense.documents)
            window = getattr(self.cfg, "sliding_window", None)
            # A sliding window shorter than the sequence, or attention sinks, need a dense mask anyway:
            # built once, for every block.
            dense = (window and window < doc_ids.shape[1]) or self.attention_sinks
            mask = dense_mask(doc_ids) if dense else Documents.of(doc_ids)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, mask) if caches is None else layer(h, cos, sin, mask, caches[i])
        h = self.norm(h) if self.norm is not None else h
        if last_only:
            # Under sequence parallel `h` is this rank's slice of the positions; the head gathers the slices
            # of every rank, the last of which is the last position.
            h = h[:, -1:]
        return self.output(h) if head and self.output is not None else h

    def keep_residual_in(self, dtype: torch.dtype) -> None:
        """Keep the residual stream in `dtype` (precision.residual_dtype under autocast): the embedding's
        output is cast once, the residual adds of autocast's low-precision outputs then stay in it, and
        the norms that read the stream return it (per-head q/k norms are not on the stream)."""
        self.residual_dtype = dtype
        for name, mod in self.named_modules():
            if isinstance(mod, RMSNorm) and not name.endswith(("q_norm", "k_norm", "kv_norm")):
                mod.out_dtype = dtype

    def make_block(self, m: Any, layer: int) -> nn.Module:
        """Block `layer` (a subclass swaps in its own, e.g. the MoE decoder's sparse blocks)."""
        return TransformerBlock(m, layer, self.make_attention(m, layer))

    def make_attention(self, m: Any, layer: int) -> Optional[nn.Module]:
        """Block `layer`'s token mixer; None: this module's Attention (a family swaps in its own, e.g. the
        Gated DeltaNet of Qwen3-Next / Qwen3.5's linear blocks, DeepSeek-V3's latent attention)."""
        return None

    def decoding_cache(self, layer: str, kv: KVCache) -> KVCache:
        """What block `layer` (its key in `layers`) decodes with: the KV cache `kv` the caller made, or a
        family's own state in its place (Qwen3-Next's linear blocks keep a recurrent state, no keys)."""
        return kv

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init keyed by (seed, parameter name): any layout, any rank, same weights.

        Works on materialised plain tensors; the runtime initialises sharded tensors through
        `init_param(name, full_shape)` so its shards equal slices of this same init.
        """
        device = self.rope_cos.device
        cos, sin = rope_cache(self.cfg, self.rope_len, device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, p in self.named_parameters():
            p.copy_(self.init_param(name, tuple(p.shape), seed).to(p.dtype))

    def buffer_values(self, device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
        """Values of the derived (non-persistent) buffers, by name suffix: the RoPE tables."""
        cos, sin = rope_cache(self.cfg, self.rope_len, device)
        return {"rope_cos": cos, "rope_sin": sin}

    def init_param(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The full (unsharded) initial value of parameter `name`, on CPU in fp32."""
        if name.endswith("norm.weight"):
            # Gemma's (1 + gain) norms start at gain 0.
            return torch.zeros(shape) if getattr(self.cfg, "norm_offset", 0.0) else torch.ones(shape)
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        if name.startswith("tok_embeddings"):
            # A tied matrix is also the output head: unit rows would give logits of size sqrt(dim).
            std = 0.02 if getattr(self.cfg, "tie_embeddings", False) else 1.0
        elif name.startswith("output"):
            std = self.cfg.dim**-0.5
        elif name.endswith(".bias"):
            return torch.zeros(shape)
        elif name.endswith(("wo.weight", "w2.weight")):
            # Residual projections scaled down with depth (GPT-2 / torchtitan practice).
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        else:
            std = 0.02
        return torch.randn(shape, generator=g).mul_(std)


def split_stage(model: nn.Module, stage_idx: int, n_stages: int, layers: range) -> nn.Module:
    """A copy of `model` keeping blocks `layers`, the embedding only on stage 0, the head on the last."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if int(key) not in layers:
            del part.layers[key]
    if stage_idx != 0:
        part.tok_embeddings = None
    if stage_idx != n_stages - 1:
        part.norm = None
        part.output = None
    return part


# The name Meta's reference and the rest of the code base know it by.
Llama = Decoder


def build_model(m: Any, rope_len: Optional[int] = None, device: str | torch.device = "meta") -> Decoder:
    """Build on `device` ('meta' costs no memory: the runtime materialises after parallelising)."""
    with torch.device(device):
        return Decoder(m, rope_len)
