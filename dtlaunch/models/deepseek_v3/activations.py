"""Saved-activation bytes per token of the deepseek_v3 blocks, op by op: the MoE decoder's FFN terms
(dtlaunch/models/moe/activations.py) with the latent attention's (mla.py) in place of the dense one.

Latent attention, no AC, per token (e = compute-dtype bytes, h = dim, H = heads, r_q / r_kv = the q / kv
ranks, n / p / v = the no-RoPE, RoPE and value widths per head), measured with saved-tensor hooks on CPU in
fp32 (tests/unit/test_deepseek_v3.py):
- the low-rank query: q_norm keeps its input (wq_a's output) and rsqrt, wq_b its output: 2e·r_q + 4;
- the kv latent: kv_norm keeps its input, a view of wkv_a's whole output (latent and rotated key,
  e·(r_kv + p)), and rsqrt; wkv_b keeps kv_norm's output (e·r_kv);
- SDPA (the fused kernel: the values are padded to the q/k width when v differs, mla.py) keeps q and k
  (both concatenations, e·H·(n + p) each), the padded v and its padded output (e·H·(n + p) each) and a
  logsumexp (4H); wo keeps its input cut from that output (e·H·v). With v = n + p nothing is padded:
  v is a view of wkv_b's whole output (e·H·(n + v)) and wo reads SDPA's output (e·H·v) as it is.
  RoPE multiplies by the constant tables and the concatenations save nothing.
Selective AC, op policy (every other matmul output in call order, SDPA's output and logsumexp): wq_a,
wkv_a and wo are saved with the low-rank query (wq, wkv_b without it), which moves the router's gate and
the experts one place later than in the dense attention's count.
Tensor parallel (tp_plan.py) splits the heads: one rank keeps its heads' share of the per-head terms (q, k,
v, SDPA's output and logsumexp, wkv_b's output, wo's input), and the whole low-rank ones (q_norm's and
kv_norm's, wkv_a's output with the rotated key every head shares); sequence parallel shards the norms'
own terms and wo's reduced output, as in the dense decoder. Context parallel is refused (check.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dtlaunch.models.dense import activations as dense
from dtlaunch.models.moe import activations as moe
from dtlaunch.models.moe.activations import (  # noqa: F401 (the planner reads these here)
    DTYPE_BYTES,
    ac_mix,
    backward_working_bytes,
    block_input_bytes,
    embedding_bytes,
    final_norm_bytes,
    logits_backward_bytes,
    logits_forward_bytes,
    norm_bytes,
    rope_cast_bytes,
    tiled_grad_sum_elements,
    tiled_saved_bytes,
    tiled_working_bytes,
)


@dataclass(frozen=True)
class BlockDims(moe.BlockDims):
    q_rank: int = 0  # 0: one q projection
    kv_rank: int = 0
    nope: int = 0
    rope: int = 0
    v: int = 0

    @classmethod
    def of(cls, m: Any) -> BlockDims:
        base = dataclasses.asdict(moe.BlockDims.of(m))
        # RoPE rotates qk_rope_head_dim dims: the tables' width (rope_cast_bytes reads `head`).
        base["hd"] = int(m.qk_rope_head_dim)
        return cls(
            **base,
            q_rank=int(m.q_lora_rank or 0),
            kv_rank=int(m.kv_lora_rank),
            nope=int(m.qk_nope_head_dim),
            rope=int(m.qk_rope_head_dim),
            v=int(m.v_head_dim),
        )

    def matmuls(self, tp: int = 1, sp: bool = False) -> list[float]:
        """Output widths one rank keeps of the attention's matmuls in call order (SDPA aside): the per-head
        ones split by tensor parallel, wo's reduced output by sequence parallel."""
        qk = self.a * (self.nope + self.rope) / tp
        q = [self.q_rank, qk] if self.q_rank else [qk]
        return [*q, self.kv_rank + self.rope, self.a * (self.nope + self.v) / tp, self.h / (tp if sp else 1)]


def attention_bytes_no_ac(d: BlockDims, e: int, tp: int = 1) -> float:
    q = 2 * e * d.q_rank + 4 if d.q_rank else 0
    kv = e * (d.kv_rank + d.rope) + 4 + e * d.kv_rank
    qk = d.nope + d.rope
    if d.v == qk:  # v a view of wkv_b's output, SDPA's output read by wo as it is
        heads = 2 * e * d.a * qk + e * d.a * (d.nope + d.v) + e * d.a * d.v + 4 * d.a
    else:  # v padded to the q/k width (a copy), the padded output, and wo's input cut from it (a copy).
        heads = 4 * e * d.a * qk + 4 * d.a + e * d.a * d.v
    return q + kv + heads / tp


def sdpa_output_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """SDPA's output (at the q/k width when the values are padded) and logsumexp, this rank's heads."""
    return (e * d.a * (d.v if d.v == d.nope + d.rope else d.nope + d.rope) + 4 * d.a) / tp


def block_bytes_no_ac(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    # The attention norm's output feeds wq_a (or wq) and wkv_a; the FFN norm's the router and experts.
    norms = norm_bytes(d, e, tp, sp, autocast, 2) + norm_bytes(d, e, tp, sp, autocast, 2)
    return norms + attention_bytes_no_ac(d, e, tp) + moe._ffn_bytes(d, e, tp)


def block_bytes_selective(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    widths = d.matmuls(tp, sp)
    attn = sum(w for i, w in enumerate(widths) if moe._saves_down(i + 1)) * e + sdpa_output_bytes(d, e, tp)
    n = len(widths)
    # Sparse blocks: the router's gate is matmul n + 1, the experts start at n + 2 (as the MoE model counts).
    local = 1 if d.grouped else max(1, d.experts // d.ep)
    first = n + 2
    with_down = sum(moe._saves_down(first + 3 * j) for j in range(local)) / local
    routed = d.routed_scale * d.top_k * e * (d.fe + with_down * d.h)
    shared = e * (d.fs + (d.h if moe._saves_down(first + 3 * local) else 0)) if d.fs else 0.0
    gate = e * d.experts if moe._saves_down(n + 1) else 0.0
    sparse = gate + routed + shared
    # Dense blocks: w1, w3, w2 at n + 1, n + 2, n + 3.
    dense_ffn = e * sum(w for i, w in enumerate((d.f / tp, d.f / tp, d.h)) if moe._saves_down(n + 1 + i))
    return block_input_bytes(d, e, tp, sp, autocast) + attn + d.sparse * sparse + (1 - d.sparse) * dense_ffn


block_bytes, block_bytes_budget = dense.ac_policy_functions(block_bytes_no_ac, block_bytes_selective)
