"""Saved-activation bytes per token of the Gated DeltaNet hybrids' blocks (qwen3_next, qwen3_5, qwen3_5_moe), op
by op: a Gated DeltaNet block (gated_deltanet.py) or a gated full-attention block, each with the dense SwiGLU
(dtlaunch/models/dense/activations.py) or the MoE FFN (dtlaunch/models/moe/activations.py) after it.

Notation, one rank's share (tensor parallel splits the linear blocks by key heads, tp_plan.py): e = compute-dtype
bytes, h = dim, H = value heads, Hk = key heads, dk / dv = their widths, Kk = Hk·dk, V = H·dv, C = 2Kk + V (the
convolution's channels), K = the kernel, c = 64 (the chunk), s = the sequence (a row) and P = s rounded up to
whole chunks (the chunked rule pads each row with zeros). The rule computes in fp32 (4 bytes) whatever e is.

Gated DeltaNet, no AC, per token of the row (measured with saved-tensor hooks on CPU, fp32 / bf16 / autocast;
tests/unit/test_qwen3_next_activations.py):
- attention norm: as the dense block's (its output read by the 4 split or 2 fused input projections);
- the output gate z: in fp32 the silu keeps z itself (split: in_proj_z's output; fused: z's copy out of
  in_proj_qkvz's per-key-head layout), e·V; in bf16 / under autocast it keeps z's fp32 copy, 4V;
- beta = sigmoid(b): its output, e·H; g = -exp(A_log)·softplus(a + dt_bias): softplus's fp32 input and output
  (the multiply keeps it), 8H;
- the causal conv1d keeps its zero-padded input, e·C·(s + K - 1) per row, and SiLU the conv's output, e·C;
- L2 norm of q and k: each keeps its fp32 heads-first copy (repeated to the H value heads) and rsqrt,
  2·(4H·dk + 4H);
- the chunked rule, per padded token (P/s of them per token): q (scaled) and k normalised, v and beta (the
  padded fp32 copies), 4H·(2dk + dv + 1); five c-wide matrices per head (the decay D, k_beta·kᵀ, the system,
  q·kᵀ and the scores), 5·4H·c; k_beta, 4H·dk; three exp of the cumulative decay, 12H; the triangular solve's
  output, 4H·(dv + dk); the decays to the chunk's start and end applied to q and k, 8H·dk; the corrections u,
  4H·dv; and per chunk the state entering it (4H·dk·dv) and the chunk's decay (4H): (4H·dk·dv + 4H)/c;
- gated RMSNorm: its fp32 input, 4V, and rsqrt, 4H; the normalised value (e·V, cast back), SiLU(z)'s fp32
  output (4V), the gain product (e·V; fp32 under autocast, the gain being fp32) and the gated output that
  out_proj keeps (e·V);
- out_proj's output is only added to the stream.
Per linear block and micro-batch, not per token (left out of these per-token terms; the test adds them): the
chunk's triangle mask (c² bools) and exp(A_log) with its negation (8H).

Packed documents (data.document_mask): `_mix_documents` moves each document to a chunk boundary of its own,
at least K - 1 positions after the previous one, and runs the convolution, the L2 norms and the rule on that
spread layout (`spread_length`: up to a chunk more per document), keeping also the spread's sources. The plan
counts the unpacked layout (one document per row: the case without documents); `documents_extra_bytes` gives
what a row of given documents keeps more (measured exact): a row of many short documents can keep several
times the unpacked rule's terms (ten documents of 10 tokens in a row of 100: each its own chunk, 6.4x).

Gated full attention: the dense block's attention (per-head (1 + gain) q/k norms, partial RoPE) plus the output
gate: q_proj is twice as wide and q_norm keeps a view of all of it (e·q more), the gate's sigmoid output (e·q)
and the gated output wo keeps (e·q): 3e·q. Under autocast its norms return the compute dtype, so RoPE casts its
tables (rope_cast_bytes, with the rotated columns only).

The FFN: the dense SwiGLU, or the MoE FFN (router, experts, shared expert) with Qwen3-Next's shared-expert gate:
its sigmoid output (e) and the shared output the multiply keeps (e·h).

Selective AC, op policy (every other aten.mm of the block saved, in call order; ac.py): the split linear block
runs in_proj_z (saved), in_proj_qkv, in_proj_b (saved), in_proj_a, out_proj (saved); the fused one in_proj_qkvz
(saved), in_proj_ba, out_proj (saved); the full-attention block wq (saved, with the gate: 2q), wk, wv (saved),
wo, plus SDPA's output and logsumexp. The rule's batched matmuls and solve are not aten.mm: recomputed. The FFN
continues the count (the dense SwiGLU's w1, w3, w2, or the router, experts, shared expert and its gate).
Full AC: the block input.

The planner sizes a stage with the mean block: `linear` is the share of Gated DeltaNet blocks (of the model,
as `sparse` is of sparse blocks), `seq` the row length the planner sets (0: a multiple of the chunk). A block's
backward (recompute under AC, working set) is sized with the kind that creates the most there (`block_kinds`):
under AC the linear block's recompute (the rule's fp32 tensors) is several times the full-attention block's.
Tensor parallel: H, Hk, the attention heads and the FFN widths are one rank's; sequence parallel shards the
norms as in the dense block. Measured on 2 gloo ranks (tests/distributed/test_gated_deltanet_tp_activations.py):
exact without AC (with and without SP), with selective AC without SP and with full AC, but for the rank's gathered
in_proj_qkv / conv1d rows its matmuls keep (per block, not per token: left out); selective AC under SP keeps
(1 + 1/tp)·e·h per token and block more there, as every dense block does: the planner adds it for every family
(shape.TP_SP_SELECTIVE_GATHERED_HIDDEN_STATES; under FSDP shape.FSDP_SP_SELECTIVE_HIDDEN_STATES).
Ulysses context parallel (strategy.cp_style=ulysses; `cp` > 1, `seq` the rank's share of the row: plan/shape.py):
the projections, gates, gated norm and out_proj run on the rank's tokens with its tp share of the heads, as
above; the convolution, the L2 norms and the chunked rule on the whole row (cp·seq positions, padded to whole
chunks of it) for key heads / (tp·cp) and their value heads (gated_deltanet._mix_exchanged): the same terms for
the whole row's length and 1/cp of the heads, cp whole-row positions per rank token (`whole_row`). The exchange
keeps nothing per token (its re-layouts' copies are not saved; the chunk loop's inputs are what the rule keeps
anyway); per block it keeps the head group's conv1d rows (C/cp x K, parameter dtype) that the convolution reads
(not per token: left out, as TP's gathered rows). The gated full attention under Ulysses keeps its output as it
comes back from the exchange (e·q: without CP a view of SDPA's saved output). Its transient buffers
(`ulysses_block_exchange_bytes`, plan/cp_terms.py) mirror the attention's (plan/ulysses_terms.py). Measured on 2
gloo ranks at cp=2 (tests/distributed/test_gated_deltanet_tp_activations.py, rows of 96, 136 and 200: the rank's
48 / 68 / 100 tokens, the rule on 128 / 192 / 256 positions): exact without AC (but for those conv1d rows and the
per-block constants) and with full AC, in fp32; with selective AC exact in most runs (a few caught one q-sized exchange's
send and receive buffers, 2·e·q per attention token, that gloo still held at the mark); bf16 / autocast and
TP x CP not measured.
Not measured either: training.compile (the eager terms are used; the budget partitioner scales them as for
the other families) and LoRA exactly: the generic adapter deltas of dtlaunch.plan.peft apply (from block_linears);
a frozen Gated DeltaNet block without adapters keeps less than they say (its frozen conv1d, gated-norm gain and
projections keep no inputs for weight gradients: 4.3 KB per token less on a tiny qwen3_5 in fp32), so the plan is
over there, not under; a gated full-attention block's delta was exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dtlaunch.models.dense import activations as dense
from dtlaunch.models.dense.shapes import rotary_dim
from dtlaunch.models.moe import activations as moe
from dtlaunch.models.moe.activations import (  # noqa: F401 (the planner reads these here)
    DTYPE_BYTES,
    ac_mix,
    block_input_bytes,
    embedding_bytes,
    final_norm_bytes,
    logits_backward_bytes,
    logits_forward_bytes,
    norm_bytes,
)
from dtlaunch.models.qwen3_next.config import layer_kinds

# The chunked rule's chunk (gated_deltanet.CHUNK_SIZE; not imported: the planner does not import torch).
CHUNK = 64


@dataclass(frozen=True)
class BlockDims(moe.BlockDims):
    linear: float = 0.0  # share of the blocks that are Gated DeltaNet
    n_k: int = 0  # key heads (the whole model's: divided by tp here)
    n_v: int = 0
    dk: int = 0
    dv: int = 0
    kernel: int = 4
    split: bool = False  # Qwen3.5's four input projections (else Qwen3-Next's two fused ones)
    output_gate: bool = True  # the full attention's sigmoid output gate
    shared_gate: bool = False  # the shared expert's sigmoid gate (Qwen3-Next)
    rot_half: int = 0  # RoPE table columns (rotary dims / 2)
    seq: int = 0  # the row length (0: a multiple of the chunk): under context parallel one rank's share
    cp: int = 1  # Ulysses context parallel (strategy.cp_style=ulysses): the linear blocks' rule runs on the whole row

    @classmethod
    def of(cls, m: Any) -> BlockDims:
        if getattr(m, "moe", None) is not None and int(m.moe.num_experts or 0) > 0:
            base = dataclasses.asdict(moe.BlockDims.of(m))
        else:
            base = {**dataclasses.asdict(dense.BlockDims.of(m)), "sparse": 0.0}
        kinds = layer_kinds(m)
        return cls(
            **base,
            linear=kinds.count("linear_attention") / len(kinds),
            n_k=int(m.linear_num_key_heads),
            n_v=int(m.linear_num_value_heads),
            dk=int(m.linear_key_head_dim),
            dv=int(m.linear_value_head_dim),
            kernel=int(m.linear_conv_kernel_dim),
            split=str(m.arch) != "qwen3_next",
            output_gate=bool(getattr(m, "attention_output_gate", False)),
            shared_gate=bool(getattr(m, "shared_expert_gate", False)),
            rot_half=rotary_dim(m) // 2,
        )

    def padded(self) -> float:
        """Padded positions per token of a row: P / s."""
        return -(-self.seq // CHUNK) * CHUNK / self.seq if self.seq else 1.0

    def widths(self, tp: int = 1) -> tuple[float, float, float, float, float]:
        """One rank's (H, Hk·dk, V, C, dk·dv): tensor parallel gives each rank tp-th of the key heads and theirs."""
        heads = self.n_v / tp
        key, value = self.n_k / tp * self.dk, heads * self.dv
        return heads, key, value, 2 * key + value, self.dk * self.dv


def rule_bytes_per_padded_token(d: BlockDims, e: int, tp: int = 1, autocast: bool = False) -> float:
    """The chunked rule's tensors kept per padded position (see the module's docstring), with n = P / c chunks.

    With one chunk the state entering it is a constant zero, so nothing keeps the queries' decayed copy for it,
    and the state it leaves is dropped with what only its update kept (the keys' decayed copy, their decay and
    the chunk's): 2dk + 1 + 1/c less per head.

    Under autocast the rule's matmuls run in the compute dtype on casts of their fp32 operands: each keeps its
    casts (bf16) instead of the fp32 tensors; the products with fp32 factors come back in fp32."""
    heads = d.n_v / tp
    n = -(-d.seq // CHUNK) if d.seq else 2**31  # chunks per row (unknown: many)
    later = (n - 1) / n  # the share of chunks after the first (their entering state has a gradient)
    state = d.dk * d.dv / CHUNK  # one chunk's state, per position
    if not autocast:
        per_head = 6 * d.dk + 3 * d.dv + 1 + 5 * CHUNK + 3 + state + 1 / CHUNK
        if n == 1:
            per_head -= 2 * d.dk + 1 + 1 / CHUNK
        return 4 * heads * per_head
    # fp32: D and the system (c each); beta and the exps of the cumulative decay; k, k_beta, the solve's
    # output (dk + dv), q and v; the exp to the chunk's end, the chunk's decay and the states the decay
    # multiplies (not the last chunk's: dropped with the final state).
    fp32 = 2 * CHUNK + 3 + 4 * d.dk + 2 * d.dv + (1 + 1 / CHUNK if n > 1 else 0) + later * state
    # compute dtype: the casts of k_beta, k (twice) and q and the two c-wide matmul outputs; per chunk the
    # entering state (twice), the scores and u; after the first chunk the solve's state part and the queries'
    # decayed copy, and but for the last the update's decayed keys and u.
    low = 4 * d.dk + 2 * CHUNK + 2 * state + CHUNK + d.dv + later * (3 * d.dk + d.dv)
    return heads * (4 * fp32 + e * low)


def whole_row(d: BlockDims, tp: int = 1) -> tuple[BlockDims, int]:
    """Where the convolution, the L2 norms and the rule run: under Ulysses context parallel (d.cp > 1) on the
    whole row (cp·d.seq positions) with key heads / (tp·cp) (gated_deltanet._mix_exchanged); else the rank's row
    with key heads / tp. Returns those dimensions and the heads' divisor."""
    if d.cp <= 1:
        return d, tp
    return dataclasses.replace(d, seq=d.seq * d.cp, cp=1), tp * d.cp


def _row_mix_bytes(d: BlockDims, e: int, tp: int, autocast: bool) -> float:
    """Per token of a row of d.seq positions: the convolution, the L2 norms and the rule (the part that runs on
    the packed-document layout's positions). Under Ulysses context parallel, per token of the rank's share: the
    whole row's terms for 1/cp of the heads, cp times as many positions as the rank's tokens."""
    if d.cp > 1:
        whole, heads_divisor = whole_row(d, tp)
        return d.cp * _row_mix_bytes(whole, e, heads_divisor, autocast)
    heads, _, _, conv, _ = d.widths(tp)
    window = 1 + (d.kernel - 1) / d.seq if d.seq else 1.0  # the zero-padded conv input, per token
    convolution = e * conv * window + e * conv
    l2 = 2 * (4 * heads * d.dk + 4 * heads)
    return convolution + l2 + d.padded() * rule_bytes_per_padded_token(d, e, tp, autocast)


def linear_mixer_bytes_no_ac(d: BlockDims, e: int, tp: int = 1, autocast: bool = False) -> float:
    """One Gated DeltaNet mixer's saved bytes per token (its input norm aside)."""
    heads, _, value, _, _ = d.widths(tp)
    fp32 = e == 4 and not autocast
    z = e * value if fp32 else 4 * value
    gates = e * heads + 8 * heads
    gated_norm = 4 * value + 4 * heads + e * value + 4 * value + (4 if autocast else e) * value + e * value
    return z + gates + _row_mix_bytes(d, e, tp, autocast) + gated_norm


def spread_length(lengths: tuple[int, ...], kernel: int) -> int:
    """Positions of one row's packed documents in gated_deltanet._document_layout: each document from a chunk
    boundary at least kernel - 1 positions after the previous one ends, the row rounded up to whole chunks."""
    end = 0
    for i, n in enumerate(lengths):
        start = 0 if i == 0 else -(-(end + kernel - 1) // CHUNK) * CHUNK
        end = start + n
    return -(-end // CHUNK) * CHUNK


def documents_extra_bytes(d: BlockDims, e: int, lengths: tuple[int, ...], tp: int = 1, autocast: bool = False) -> float:
    """What one Gated DeltaNet block keeps more, without AC, for one row of packed documents (`lengths`) than
    for the same row unpacked (what the plan counts): the convolution, L2 norms and rule on the spread layout's
    positions instead of the row's, the spread's sources (the [q | k | v] input, e·C, and g, 4H, per token) and
    a reset flag per chunk (a bool).
    The layout's int64 positions (8 bytes per token) are built once per batch for every block (not counted)."""
    s = sum(lengths)
    spread = spread_length(lengths, d.kernel)
    heads, _, _, conv, _ = d.widths(tp)
    packed = _row_mix_bytes(dataclasses.replace(d, seq=spread), e, tp, autocast) * spread
    unpacked = _row_mix_bytes(dataclasses.replace(d, seq=s), e, tp, autocast) * s
    return packed - unpacked + (e * conv + 4 * heads) * s + spread // CHUNK  # and the chunks' reset flags


def ulysses_block_exchange_bytes(d: BlockDims, e: int, tp: int, tokens: int, backward: bool) -> float:
    """Inside one linear block's forward (backward) under Ulysses context parallel, the exchange's transient
    buffers for `tokens` of the rank's: its [q | k | v] per key head before the convolution (e·C) and the fp32
    [g | beta] (8H), sent and received (and in backward their gradients on the head shards besides), as
    plan/ulysses_terms.py counts the attention's; the output's exchange (e·V) comes after they are freed.
    (plan/cp_terms.py takes the larger of this and the attention's.)"""
    if d.cp <= 1 or d.linear <= 0:
        return 0.0
    heads, _, _, conv, _ = d.widths(tp)
    return (3 if backward else 2) * (e * conv + 8 * heads) * tokens


def linear_constant_bytes(d: BlockDims, tp: int = 1) -> float:
    """Per linear block and micro-batch: the chunk's triangle mask and exp(A_log) with its negation."""
    return CHUNK * CHUNK + 8 * d.n_v / tp


def _full_attention(d: BlockDims) -> dense.BlockDims:
    return dense.BlockDims(h=d.h, k=d.k, f=0, a=d.a, vocab=d.vocab, q=d.q, qk_norm=d.qk_norm, hd=d.hd)


def _shared_gate_bytes(d: BlockDims, e: int) -> float:
    return e * d.h + e if d.shared_gate and d.fs else 0.0


def _ffn_bytes(d: BlockDims, e: int, tp: int) -> float:
    return moe._ffn_bytes(d, e, tp) + d.sparse * _shared_gate_bytes(d, e)


def block_bytes_no_ac(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    ffn = norm_bytes(d, e, tp, sp, autocast, 2) + _ffn_bytes(d, e, tp)
    linear = norm_bytes(d, e, tp, sp, autocast, 4 if d.split else 2) + linear_mixer_bytes_no_ac(d, e, tp, autocast)
    full = dense.block_bytes_no_ac(_full_attention(d), e, tp, sp, autocast, compiled) - norm_bytes(
        d, e, tp, sp, autocast, 2
    )
    if d.output_gate:
        full += 3 * e * d.qw / tp
    if d.cp > 1:
        # Ulysses: the attention's output comes back from the exchange as a tensor of its own, which the gate's
        # multiply (or wo) keeps beside SDPA's saved output on the head shards (without CP a view of it).
        full += e * d.qw / tp
    return d.linear * linear + (1 - d.linear) * full + ffn


def _ffn_selective(d: BlockDims, e: int, tp: int, n: int, residual: float) -> float:
    """The FFN's saved matmul outputs when it starts after the block's `n`-th matmul (moe._saves_down's parity)."""
    saves = moe._saves_down
    local = 1 if d.grouped else max(1, d.experts // d.ep) if d.experts else 1
    first = n + 2
    with_down = sum(saves(first + 3 * j) for j in range(local)) / local
    routed = d.routed_scale * d.top_k * e * (d.fe + with_down * d.h)
    shared = e * (d.fs + (d.h if saves(first + 3 * local) else 0)) if d.fs else 0.0
    if d.fs and d.shared_gate and saves(first + 3 * local + 3):
        shared += e
    gate = e * d.experts if saves(n + 1) else 0.0
    dense_ffn = e * sum(w for i, w in enumerate((d.f / tp, d.f / tp)) if saves(n + 1 + i))
    dense_ffn += residual if saves(n + 3) else 0.0
    return d.sparse * (gate + routed + shared) + (1 - d.sparse) * dense_ffn


def block_bytes_selective(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    # Outputs reduced to the residual (out_proj, wo, w2) are sequence-sharded under SP; compiled, not kept.
    residual = 0.0 if compiled else e * d.h / (tp if tp > 1 and sp else 1)
    heads, key, value, _, _ = d.widths(tp)
    if d.split:  # in_proj_z, in_proj_b and out_proj of the five
        linear, n_linear = e * (value + heads) + residual, 5
    else:  # in_proj_qkvz and out_proj of the three
        linear, n_linear = e * (2 * key + 2 * value) + residual, 3
    # wq (with the gate, twice as wide) and wv of the four, SDPA's output and logsumexp.
    full = (e * ((2 if d.output_gate else 1) * d.qw + d.k + d.qw) + 4 * d.a) / tp
    linear += _ffn_selective(d, e, tp, n_linear, residual)
    full += _ffn_selective(d, e, tp, 4, residual)
    return block_input_bytes(d, e, tp, sp, autocast) + d.linear * linear + (1 - d.linear) * full


block_bytes, block_bytes_budget = dense.ac_policy_functions(block_bytes_no_ac, block_bytes_selective)


def rope_cast_bytes(d: BlockDims, e: int, seq: int) -> float:
    """Per block and micro-batch, as the dense block's: the full-attention blocks' cast RoPE tables (their rotated
    columns only), in the mean block's share."""
    return 0.0 if e == 4 else (1 - d.linear) * 4 * seq * d.rot_half * e


def backward_working_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """Inside a block's backward: the FFN's (moe / dense), or in a linear block the rule's, if larger. The rule's
    backward holds a chunk-wide gradient and the q / k / v-wide ones per head at once: 4H·(c + dk + dv) per padded
    position bounds it (one Gated DeltaNet block alone, 8 heads of 32, rows of 256: 3.2 KB per token over what
    it held, against 4.1 KB for this term; below the FFN's at the published shapes)."""
    ffn = moe.backward_working_bytes(d, e, tp) if d.sparse else dense.backward_working_bytes(d, e, tp)
    whole, heads_divisor = whole_row(d, tp)  # under Ulysses CP: the whole row, 1/cp of the heads
    rule = d.cp * whole.padded() * 4 * d.n_v / heads_divisor * (CHUNK + d.dk + d.dv)
    return d.linear * max(ffn, rule) + (1 - d.linear) * ffn


def flash_backward_bytes(d: BlockDims, e: int, tp: int = 1) -> float | None:
    """Per token, CUDA's flash-attention backward in a gated full-attention block: the dense block's on its
    heads (the gate's sigmoid and product run outside SDPA). A model of Gated DeltaNet blocks only has none.
    The planner takes the larger of this and the mean block's backward working set, then adds the larger
    kind's recompute (dtlaunch.plan.backward): where the attention's moment is the larger, that pairs the
    full block's moment with the linear block's recompute, an over-count of their difference, never an
    under-count."""
    if d.linear >= 1:
        return None
    return dense.flash_backward_bytes(_full_attention(d), e, tp)


def block_kinds(d: BlockDims) -> list[BlockDims]:
    """The stage's block kinds, each as a BlockDims of its own (the planner sizes a stage with the mean block;
    dtlaunch.plan.backward sizes a block's backward with the kind that creates the most there). Under AC a Gated
    DeltaNet block recomputes far more than a full-attention one (the chunked rule's fp32 tensors): the mean
    block's recompute put qwen3_5 (3 linear blocks in 4) ZeRO-3 selective 4.5 % under a real 2-rank run
    (bench/planner_accuracy.py --families, row 28), where the peak is inside a linear block's backward."""
    return [dataclasses.replace(d, linear=share) for share in (1.0, 0.0) if (d.linear if share else 1 - d.linear) > 0]


def tiled_saved_bytes(d: BlockDims, e: int, tp: int, compiled: bool) -> float:
    return moe.tiled_saved_bytes(d, e, tp, compiled) if d.sparse else dense.tiled_saved_bytes(d, e, tp, compiled)


def tiled_working_bytes(d: BlockDims, e: int, tp: int, tiles: int) -> float:
    return moe.tiled_working_bytes(d, e, tp, tiles) if d.sparse else dense.tiled_working_bytes(d, e, tp, tiles)


def tiled_grad_sum_elements(d: BlockDims, tp: int = 1) -> float:
    return moe.tiled_grad_sum_elements(d, tp) if d.sparse else dense.tiled_grad_sum_elements(d, tp)
