"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, in plain torch ops.

Each value head keeps a (head_k_dim x head_v_dim) fast-weight matrix S as its state instead of a KV cache.
Per token t, with a decay a_t = exp(g_t) in (0, 1] and a write strength beta_t in (0, 1):

    S_t = a_t * S_{t-1} + k_t (beta_t * (v_t - S_{t-1}'^T k_t))^T    where S_{t-1}' = a_t * S_{t-1}
    o_t = S_t^T q_t

i.e. the decayed state predicts v_t from k_t and only the error of that prediction is written back
(the delta rule). Before that, q, k and v pass through a short depthwise causal convolution with SiLU,
and q, k are L2-normalised; after it, the output is RMS-normalised per head and gated by SiLU(z).

Training and prefill use the chunked (WY / UT-transform) form of the recurrence: within a chunk of 64
tokens the writes are solved for at once with a triangular solve, and only the chunks run in sequence.
A single decoding step runs the recurrence directly. Both are fp32 inside.

Packed documents (data.document_mask: a `Documents` in the place of the mask) see nothing of the documents
before them in their row: the convolution reads zeros before each document's start and the state starts
from zero there, as if each document ran alone. Each document is moved to a chunk boundary of its own
(`_document_layout`), far enough from the previous one that the convolution's window reads only the zeros
between them, and the chunk loop zeroes the state at each document's first chunk: one run over all rows
and documents, exact (no large-negative decay standing in for a reset).

Parameter names and shapes are transformers' `Qwen3NextGatedDeltaNet` (in_proj_qkvz, in_proj_ba, conv1d,
dt_bias, A_log, norm, out_proj) or, with `split_projections`, `Qwen3_5GatedDeltaNet` (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a in the place of the two fused ones), so a checkpoint's `linear_attn.*`
tensors load by name; the numerics follow its torch fallback (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_*, Qwen3NextRMSNormGated). This module knows nothing of
torch.distributed.

Tensor parallel (tp_plan.py) gives each rank whole key heads and the value heads they serve: the forward
takes its head counts from what its projections return, in_proj_qkv and conv1d compute this rank's q, k
and v channels, and A_log / dt_bias (`head_parameters`) are this rank's value heads' entries.

Context parallel (strategy.cp_style=ulysses) sets `sequence_exchange` (train/parallel/ulysses.py's
UlyssesHeads): the projections, g and beta run on this rank's tokens of every head; per key head, its
[q | k | v of its value heads] before the convolution (and its value heads' g, beta) are exchanged for the
whole sequence, in order, of key heads / cp heads (`_mix_exchanged`): the convolution (those heads'
channels) and the chunked rule run there, and the reverse exchange brings back this rank's tokens of every
head for the gated norm and out_proj. The exchange is an object handed in: no collectives here.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtlaunch.models.dense.documents import Documents
from dtlaunch.models.dense.model import KVCache
from dtlaunch.models.local_tensor import local_tensor

# Tokens per chunk of the chunked rule (transformers' and FLA's default).
CHUNK_SIZE = 64
# The L2 normalisation of q and k inside the rule: x * rsqrt(sum(x^2) + eps), as FLA's kernels.
QK_L2_EPS = 1e-6

MASK_REFUSED = (
    "Gated DeltaNet takes packed documents as their lengths (Documents), not a dense mask: "
    "dense document or padding masks are not supported"
)


class RecurrentState(KVCache):
    """One Gated DeltaNet block's decoding state, in the place of a KV cache (Qwen3NextDecoder.decoding_cache):
    batched generation selects, keeps and drops its rows as it does a cache's; it holds no keys."""

    static = False

    def __init__(self, key_mask: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.conv: Optional[torch.Tensor] = None  # (B, conv_dim, K-1): the last K-1 conv inputs
        self.recurrent: Optional[torch.Tensor] = None  # (B, n_v, head_k_dim, head_v_dim) fp32
        self.seen = 0  # positions consumed so far
        self.key_mask = (
            key_mask  # optional (B, >= seen + new) bool, True = a real token (shared, updated by the caller)
        )

    @property
    def length(self) -> int:
        return self.seen

    def select_rows(self, index: torch.Tensor, key_mask: Optional[torch.Tensor]) -> None:
        assert self.conv is not None and self.recurrent is not None
        self.conv, self.recurrent = self.conv.index_select(0, index), self.recurrent.index_select(0, index)
        self.key_mask = key_mask

    def keep_rows(self, keep: torch.Tensor, key_mask: torch.Tensor) -> None:
        self.select_rows(keep, key_mask)

    def drop_last(self, n: int) -> None:
        raise NotImplementedError("a recurrent state cannot forget positions (sequence parallel is refused for it)")


class GatedRMSNorm(nn.Module):
    """RMSNorm over a head's values, times a plain gain, times SiLU(gate) (Qwen3NextRMSNormGated).

    The rounding points are transformers': normalise in fp32, round to the input dtype, multiply by the
    gain (in the gain's dtype, so an fp32 gain promotes), multiply by SiLU of the fp32 gate, round again."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * normed.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = QK_L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads_first_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The rule's common preparation. In: q, k (B, S, n_k, dk), v (B, S, n_v, dv), g, beta (B, S, n_v).
    Out, fp32 and heads first: q, k (B, n_v, S, dk) normalised (q also scaled by dk^-1/2), v (B, n_v, S, dv),
    g, beta (B, n_v, S)."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        # Value head h reads key head h // groups: consecutive value heads share a key head.
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token (decoding steps; a reference for the chunked form).

    q, k (B, S, n_k, dk), v (B, S, n_v, dv), g (log decay, <= 0) and beta (B, S, n_v); `state`
    (B, n_v, dk, dv) or None (zeros). Returns the output (B, S, n_v, dv) in q's dtype and the fp32 state."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    outs = []
    for t in range(s):
        k_t = k[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        correction = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * correction[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    out = torch.stack(outs, dim=2)
    return out.transpose(1, 2).contiguous().to(dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    chunk_size: int = CHUNK_SIZE,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as `recurrent_gated_delta_rule` (same arguments and results), chunk by chunk.
    `resets` (B, chunks) bool: the state is zero on entering these chunks (each a packed document's first).

    Within a chunk, with G_i the cumulative log decay from the chunk's start to position i and
    D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal), the writes u_i (the delta rule's corrected
    values) satisfy u_i = beta_i (v_i - S0'^T k_i - sum_{j<i} D_ij k_i.k_j u_j), S0' the state entering
    the chunk decayed to i. That is a unit lower-triangular system (I + L) u = beta v - ..., L_ij =
    beta_i D_ij k_i.k_j, solved once for the values and once for the state's part (its right-hand side
    is linear in S0, so it is solved for beta_i e^{G_i} k_i and applied to S0 afterwards)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]

    # Pad to whole chunks. Padded tokens have k = v = beta = 0 and g = 0: they neither write nor decay.
    pad = -s % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk_size
    q, k, v = (t.reshape(b, h, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(b, h, n, chunk_size) for t in (g, beta))

    cum = g.cumsum(-1)  # G_i, <= 0 and non-increasing along the chunk
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # D_ij; the masked entries would be exp of a positive number (overflow), so they go to -inf first.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strictly lower triangle is read
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, state_reads = solved[..., :dv], solved[..., dv:]
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included

    # The decays from the chunk's start to each query, and from each key to the chunk's end.
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    outs = []
    for i in range(n):
        if resets is not None:
            state = torch.where(resets[:, i, None, None, None], 0.0, state)
        u = writes[:, :, i] - state_reads[:, :, i] @ state
        outs.append(q_from_start[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :s]
    return out.transpose(1, 2).contiguous().to(dtype), state


class GatedDeltaNet(nn.Module):
    def __init__(self, m: Any, split_projections: bool = False) -> None:
        """`split_projections`: Qwen3.5's four input projections, each head after head; else Qwen3-Next's
        two fused ones, laid out per key head (see `_project`). The rest of the layer is the same."""
        super().__init__()
        dim = int(m.dim)
        self.n_k, self.n_v = int(m.linear_num_key_heads), int(m.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = int(m.linear_key_head_dim), int(m.linear_value_head_dim)
        if self.n_v % self.n_k:
            raise ValueError(
                f"linear_num_value_heads ({self.n_v}) must be a multiple of linear_num_key_heads ({self.n_k})"
            )
        self.kernel = int(m.linear_conv_kernel_dim)
        self.key_dim, self.value_dim = self.n_k * self.head_k_dim, self.n_v * self.head_v_dim
        # q, k and v go through the convolution, z (the output gate) does not.
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = nn.Linear(dim, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, self.n_v, bias=False)
            self.in_proj_a = nn.Linear(dim, self.n_v, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * self.n_v, bias=False)
        # Depthwise; forward pads it itself (zeros, or the cached inputs), so the module's padding is unused.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        # Meta-safe placeholders; the real initial values come from `initial_value` or a checkpoint.
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.head_v_dim, float(m.norm_eps))
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)
        # One entry per value head: tensor parallel shards them with the heads (dim 0).
        self.head_parameters: tuple[str, ...] = ("A_log", "dt_bias")
        # Context parallel's head exchange (strategy.cp_style=ulysses installs it; see the module docstring):
        # to_heads / to_tokens on (B, heads, tokens, D), `cp` and `rank` (the head group it receives).
        self.sequence_exchange: Optional[Any] = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any = None,
        cache: Optional[RecurrentState] = None,
    ) -> torch.Tensor:
        """x (B, S, dim) -> (B, S, dim). `cos`, `sin`: ignored (no RoPE here). `mask`: None (causal over the
        whole sequence) or packed `Documents` (each document alone); ignored while decoding with `cache`,
        where padding comes from its key_mask."""
        docs = mask if cache is None and isinstance(mask, Documents) else None
        if cache is None and mask is not None and docs is None:
            raise ValueError(MASK_REFUSED)
        b, s, _ = x.shape
        if cache is not None and cache.key_mask is not None:
            # Padding rows become zero inputs: zero q, k, v, z, a and b. With k = v = 0 a token writes nothing
            # (the state only decays, and a left-padded prompt's state is still zero), so the real tokens
            # see what they would without the padding. transformers' apply_mask_to_padding_states.
            real = cache.key_mask[:, cache.seen : cache.seen + s]
            x = (x * real[:, :, None]).to(x.dtype)

        q, k, v, z, beta_logit, a = self._project(x)
        # This rank's widths (all of them without tensor parallel).
        widths = (q.shape[-1], k.shape[-1], v.shape[-1])
        beta = beta_logit.sigmoid()
        # A = exp(A_log) > 0 and the step dt = softplus(a + dt_bias) > 0, so g = -A dt < 0: a decay.
        # fp32 first: in fp16, exp(A_log) can overflow.
        a_log, dt_bias = local_tensor(self.A_log), local_tensor(self.dt_bias)
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        mixed = torch.cat((q, k, v), dim=-1)
        exchange = self.sequence_exchange if cache is None else None
        if exchange is not None:
            if docs is not None:
                raise ValueError("Gated DeltaNet under context parallel takes no packed documents")
            out = self._mix_exchanged(exchange, mixed, widths, g, beta)
        elif docs is not None:
            out = self._mix_documents(mixed, widths, g, beta, docs)
        else:
            out, state = self._mix(mixed, widths, g, beta, cache)
            if cache is not None:
                cache.recurrent = state
                cache.seen += s

        out = self.norm(out, z)  # per head: (B, S, n_v, head_v_dim)
        return self.out_proj(out.reshape(b, s, widths[2]))

    def _mix(
        self,
        mixed: torch.Tensor,
        widths: tuple[int, int, int],
        g: torch.Tensor,
        beta: torch.Tensor,
        cache: Optional[RecurrentState] = None,
        resets: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution and the rule: mixed (B, S, conv_dim) = [q | k | v] before the convolution (their
        `widths`: this rank's heads under tensor parallel), g and beta (B, S, n_v) -> the output
        (B, S, n_v, head_v_dim) and the state after it."""
        b, s, _ = mixed.shape
        q, k, v = torch.split(self._conv(mixed, cache), widths, dim=-1)
        q = q.reshape(b, s, -1, self.head_k_dim)
        k = k.reshape(b, s, -1, self.head_k_dim)
        v = v.reshape(b, s, -1, self.head_v_dim)
        state = cache.recurrent if cache is not None else None
        if s == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return chunk_gated_delta_rule(q, k, v, g, beta, state, resets=resets)

    def _mix_exchanged(
        self, exchange: Any, mixed: torch.Tensor, widths: tuple[int, int, int], g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        """`_mix` under context parallel: mixed (B, S_local, conv_dim), g and beta (B, S_local, n_v) of this
        rank's tokens and every head -> the output (B, S_local, n_v, head_v_dim), computed on the whole
        sequence of key heads / cp heads (the exchange's head group `rank`) and their value heads."""
        b, s, _ = mixed.shape
        dk, dv = self.head_k_dim, self.head_v_dim
        nk = widths[0] // dk
        r = widths[2] // dv // nk  # value heads per key head
        cp = int(exchange.cp)
        if nk % cp:
            raise ValueError(f"context parallel: {nk} key heads per rank do not divide by strategy.cp={cp}")
        q, k, v = torch.split(mixed, widths, dim=-1)
        # Per key head: [q | k | its value heads' v] in the activations' dtype, [g | beta] in fp32 (g's own).
        packed = torch.cat((q.reshape(b, s, nk, dk), k.reshape(b, s, nk, dk), v.reshape(b, s, nk, r * dv)), dim=-1)
        side = torch.cat((g.reshape(b, s, nk, r), beta.to(g.dtype).reshape(b, s, nk, r)), dim=-1)
        packed = exchange.to_heads(packed.transpose(1, 2))  # (B, nk / cp, S, 2 dk + r dv), S in order
        side = exchange.to_heads(side.transpose(1, 2))
        n, s_all = packed.shape[1], packed.shape[2]
        q, k, v = (t.transpose(1, 2).flatten(2) for t in torch.split(packed, (dk, dk, r * dv), dim=-1))
        g_h, beta_h = (t.transpose(1, 2).flatten(2) for t in torch.split(side, (r, r), dim=-1))
        # The convolution's channels of this head group: its slice of each of q, k, v.
        group = int(exchange.rank)
        kw, vw = n * dk, n * r * dv
        rows = [(group * kw, kw), (widths[0] + group * kw, kw), (2 * widths[0] + group * vw, vw)]
        weight = _conv_weight(self.conv1d)
        weight = torch.cat([weight.narrow(0, a, m) for a, m in rows])
        h = F.pad(torch.cat((q, k, v), dim=-1).transpose(1, 2), (self.kernel - 1, 0))
        conv = F.silu(F.conv1d(h.to(weight.dtype), weight, None, groups=weight.shape[0]))
        q, k, v = torch.split(conv.to(mixed.dtype).transpose(1, 2), (kw, kw, vw), dim=-1)
        out, _ = chunk_gated_delta_rule(
            q.reshape(b, s_all, n, dk),
            k.reshape(b, s_all, n, dk),
            v.reshape(b, s_all, n * r, dv),
            g_h,
            beta_h.to(beta.dtype),
        )
        out = exchange.to_tokens(out.reshape(b, s_all, n, r * dv).transpose(1, 2))  # (B, nk, S_local, r dv)
        return out.transpose(1, 2).reshape(b, s, nk * r, dv)

    # Eager under training.compile, as the dense attention over documents: new lengths are not a recompile.
    @torch.compiler.disable
    def _mix_documents(
        self, mixed: torch.Tensor, widths: tuple[int, int, int], g: torch.Tensor, beta: torch.Tensor, docs: Documents
    ) -> torch.Tensor:
        """`_mix` with each packed document alone: spread to `_document_layout`'s positions (zeros between),
        run once with the state reset at each document's first chunk, and gathered back. The zeros between
        documents are exact no-ops for the rule whatever the convolution makes of them there: beta = 0 (no
        write) and g = 0 (no decay)."""
        b, s, _ = mixed.shape
        where, resets, p = _document_layout(docs.lengths, CHUNK_SIZE, self.kernel - 1)
        where, resets = where.to(mixed.device), resets.to(mixed.device)

        def spread(t: torch.Tensor) -> torch.Tensor:  # (B, S, ...) -> (B, P, ...), zeros between documents
            rest = t.shape[2:]
            return t.new_zeros(b * p, *rest).index_copy(0, where, t.reshape(b * s, *rest)).view(b, p, *rest)

        out, _ = self._mix(spread(mixed), widths, spread(g), spread(beta), resets=resets)
        heads = out.shape[2]
        return out.reshape(b * p, heads, self.head_v_dim).index_select(0, where).view(b, s, heads, -1)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, S, dim) -> q, k (B, S, key_dim), v (B, S, value_dim), z (B, S, n_v, head_v_dim), b and a
        (B, S, n_v), of this rank's heads under tensor parallel (counted from the projections' widths).
        Split (Qwen3.5): in_proj_qkv is [all q heads | all k heads | all v heads], the very order the
        convolution takes, and z, b, a are one projection each, head after head. Fused
        (Qwen3-Next): laid out per key head, as its checkpoints (and transformers'
        fix_query_key_value_ordering): in_proj_qkvz is n_k groups of [q | k | its value heads' v | their z],
        in_proj_ba n_k groups of [its value heads' b | their a]."""
        bsz, s, _ = x.shape
        r = self.n_v // self.n_k  # value heads per key head
        if self.split_projections:
            z = self.in_proj_z(x).view(bsz, s, -1, self.head_v_dim)
            n_v = z.shape[2]
            key_dim, value_dim = n_v // r * self.head_k_dim, n_v * self.head_v_dim
            q, k, v = torch.split(self.in_proj_qkv(x), (key_dim, key_dim, value_dim), dim=-1)
            return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)
        widths = (self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim)
        qkvz = self.in_proj_qkvz(x).view(bsz, s, -1, sum(widths))
        q, k, v, z = torch.split(qkvz, widths, -1)
        ba = self.in_proj_ba(x).view(bsz, s, -1, 2 * r)
        b, a = torch.split(ba, (r, r), dim=-1)
        return (
            q.flatten(2),
            k.flatten(2),
            v.flatten(2),
            z.reshape(bsz, s, -1, self.head_v_dim),
            b.flatten(2),
            a.flatten(2),
        )

    def _conv(self, mixed: torch.Tensor, cache: Optional[RecurrentState]) -> torch.Tensor:
        """SiLU(causal depthwise conv) over (B, S, conv_dim); with a cache the window reaches back into the
        previous calls' inputs (zeros before the first), and the cache keeps the last K-1 inputs."""
        s, dtype = mixed.shape[1], mixed.dtype
        h = mixed.transpose(1, 2)  # (B, C, S)
        if cache is None:
            h = F.pad(h, (self.kernel - 1, 0))
        else:
            past = cache.conv if cache.conv is not None else h.new_zeros(h.shape[0], h.shape[1], self.kernel - 1)
            h = torch.cat((past.to(h.dtype), h), dim=-1)
            cache.conv = h[:, :, h.shape[-1] - (self.kernel - 1) :]
        # Depthwise over this rank's channels (the module pads nothing: padding 0).
        out = F.silu(self.conv1d(h.to(self.conv1d.weight.dtype)))[:, :, -s:]
        return out.to(dtype).transpose(1, 2)


def _conv_weight(conv: nn.Module) -> torch.Tensor:
    """The depthwise convolution's weight as its forward computes with it: tensor parallel's WholeWeights
    (dtlaunch.train.parallel.tensor_parallel) gathers this rank's channels (`_tp_weight`)."""
    rows = getattr(conv, "_tp_weight", None)
    return rows() if callable(rows) else conv.weight


@functools.lru_cache(maxsize=8)
def _document_layout(
    lengths: tuple[tuple[int, ...], ...], chunk: int, gap: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where packed documents go so that one chunked run treats each alone (built once per batch, on the
    host). Each row's documents keep their order; each starts on a chunk boundary (so that a state reset
    between chunks is a reset at its start) with at least `gap` = kernel - 1 free positions before it (so
    that the causal convolution reads zeros there, as at a sequence's start). Returns: for each token of
    the (B, S) batch, its flat index into (B, P); (B, P / chunk) bool, True at each document's first chunk;
    P, a whole number of chunks."""
    rows, starts = [], []
    for row in lengths:
        end, firsts, spans = 0, [], []
        for i, n in enumerate(row):
            start = 0 if i == 0 else -(-(end + gap) // chunk) * chunk
            spans.append(torch.arange(start, start + n))
            firsts.append(start // chunk)
            end = start + n
        rows.append(torch.cat(spans))
        starts.append(firsts)
    p = -(-max(int(r[-1]) + 1 for r in rows) // chunk) * chunk
    where = torch.cat([r + i * p for i, r in enumerate(rows)])
    resets = torch.zeros(len(rows), p // chunk, dtype=torch.bool)
    for i, firsts in enumerate(starts):
        resets[i, firsts] = True
    return where, resets, p


def initial_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> Optional[torch.Tensor]:
    """The fp32 initial value of a Gated DeltaNet parameter (`name` a full or block-relative name ending
    in this layer's parameter names), or None for the parameters it has no own rule for (the projections:
    the model's default). As transformers' Qwen3-Next init: A = exp(A_log) uniform in [0.01, 16) (the lower
    bound keeps A_log finite), dt_bias 1, the gated norm's plain gain 1, the convolution normal(0, 0.02).

    The gated norm matches `<module>.norm.weight` only: a bare `norm.weight` is the decoder's final norm."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=g).log_()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith(".norm.weight"):
        return torch.ones(shape)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=g).mul_(0.02)
    return None


def state_bytes(m: Any, batch: int, dtype_bytes: int) -> int:
    """Bytes of one block's decoding state for `batch` sequences: the conv window (K-1 inputs of q, k, v)
    in the activation dtype (`dtype_bytes` each) and the fp32 recurrent state."""
    n_k, n_v = int(m.linear_num_key_heads), int(m.linear_num_value_heads)
    dk, dv = int(m.linear_key_head_dim), int(m.linear_value_head_dim)
    conv_dim = 2 * n_k * dk + n_v * dv
    conv = batch * conv_dim * (int(m.linear_conv_kernel_dim) - 1) * dtype_bytes
    recurrent = batch * n_v * dk * dv * 4
    return conv + recurrent
