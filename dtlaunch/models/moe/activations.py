"""Saved-activation bytes per token of the MoE decoder's blocks (dtlaunch/models/moe/layer.py), op by op.

Attention and the norms are the dense block's (dtlaunch/models/dense/activations.py). A sparse block's
FFN keeps, per token (e = compute-dtype bytes, h = dim, F = expert width, k = top_k, E = experts; the
router computes in fp32), measured with saved-tensor hooks on CPU in fp32 and bf16 (exact):
- router: softmax / sigmoid output 4E, top-k ids 8k, with normalised weights their fp32 pre-norm
  values and the sum (4k + 8), and the weights the combine multiplies by (4k in fp32, e·k cast);
- dispatch: the stable-sort order and the token index of every copy (8k each), the grouped copies
  (k·e·h), saved by the experts' first matmuls;
- experts: per routed copy the gate and up outputs, SiLU output and their product (4·e·F each; gpt-oss's
  clamped SwiGLU 7·e·F, its expert biases 8 bytes of expert index per copy under the grouped kernel);
- combine: the expert outputs back in token order (k·e·h), saved by the multiply by the weights;
- shared experts: one SwiGLU (4·e·F_shared); its input is the norm output, counted with the norm.
The routed terms (dispatch copies, experts, combine) are what one rank holds for its tokens; under
expert parallelism a rank instead holds the copies routed to its experts, `routed_scale` times the
balanced share (plan.moe_imbalance: the busiest rank's load over the mean), which the planner sets.
Blocks that are dense (model.moe.sparse_step / dense_layers) keep the dense SwiGLU; the planner sizes
a stage with the mean block (`sparse` = the share of sparse blocks).
Tensor parallel splits each routed and shared expert on its width (dtlaunch/models/moe/tp_plan.py): the
planner hands these functions `fe` and `fs` as one rank's slice (dtlaunch.plan.shape); the router, the
dispatch's copies and the combine stay whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dtlaunch.models.dense import activations as dense
from dtlaunch.models.dense.activations import (  # noqa: F401 (the planner reads these here)
    DTYPE_BYTES,
    ac_mix,
    block_input_bytes,
    embedding_bytes,
    final_norm_bytes,
    logits_backward_bytes,
    logits_forward_bytes,
    norm_bytes,
    rope_cast_bytes,
)
from dtlaunch.models.moe.shapes import expert_dim, shared_dim, sparse_layers


@dataclass(frozen=True)
class BlockDims(dense.BlockDims):
    experts: int = 0
    top_k: int = 1
    fe: int = 0  # one routed expert's width
    fs: int = 0  # the shared experts' width (0: none)
    norm_topk: bool = True
    sparse: float = 1.0  # share of the blocks that are sparse
    routed_scale: float = 1.0  # routed copies on this rank over the balanced share (expert parallel)
    ep: int = 1  # expert-parallel degree: a rank runs experts / ep of them
    grouped: bool = False  # the experts run as torch's grouped GEMM (three calls), not a loop per expert
    clamped: bool = False  # gpt-oss's clamped SwiGLU (7 F-wide tensors kept per copy, not 4)
    expert_bias: bool = False  # gpt-oss's expert biases (the grouped kernel keeps each copy's expert index)

    @classmethod
    def of(cls, m: Any) -> BlockDims:
        base = dense.BlockDims.of(m)
        return cls(
            **dataclasses.asdict(base),
            experts=int(m.moe.num_experts),
            top_k=int(m.moe.top_k),
            fe=expert_dim(m),
            fs=shared_dim(m),
            norm_topk=bool(m.moe.norm_topk),
            sparse=len(sparse_layers(m)) / int(m.n_layers),
            clamped=getattr(m, "swiglu_limit", None) is not None,
            expert_bias=bool(getattr(m, "expert_biases", False)),
        )


def _attention_only(d: BlockDims) -> dense.BlockDims:
    return dense.BlockDims(
        h=d.h, k=d.k, f=0, a=d.a, vocab=d.vocab, q=d.q, qk_norm=d.qk_norm, hd=d.hd, sink_dims=d.sink_dims
    )


def router_bytes(d: BlockDims, e: int) -> float:
    k = d.top_k
    return 4 * d.experts + 8 * k + ((4 * k + 8) if d.norm_topk else 0) + (4 * k if e == 4 else e * k)


def routed_bytes(d: BlockDims, e: int) -> float:
    """Per token, the bytes that scale with the routed copies a rank holds (dispatch, experts, combine)."""
    k = d.top_k
    index = 8 * k if d.expert_bias and d.grouped else 0
    return 16 * k + 2 * k * e * d.h + glu_saves(d) * k * e * d.fe + index


def glu_saves(d: BlockDims) -> int:
    """F-wide tensors one routed copy keeps: SwiGLU's gate, SiLU, up and product (4); gpt-oss's clamped form
    also its clamped gate, sigmoid, up + 1 and gated value, the raw gate and up kept by the clamps (7)."""
    return 7 if d.clamped else 4


def moe_ffn_bytes(d: BlockDims, e: int) -> float:
    return router_bytes(d, e) + d.routed_scale * routed_bytes(d, e) + 4 * e * d.fs


def _ffn_bytes(d: BlockDims, e: int, tp: int) -> float:
    return d.sparse * moe_ffn_bytes(d, e) + (1 - d.sparse) * 4 * e * d.f / tp


def block_bytes_no_ac(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    return dense.block_bytes_no_ac(_attention_only(d), e, tp, sp, autocast, compiled) + _ffn_bytes(d, e, tp)


# Matmuls of a sparse block before its first expert: wq, wk, wv, wo and the router's gate.
_MATMULS_BEFORE_EXPERTS = 5


def _saves_down(position: int) -> bool:
    """Whether the op policy saves the gate (w1) and down (w2) outputs of the SwiGLU whose w1 is the
    `position`-th (1-based) matmul of the block: it saves the odd-numbered ones, so a SwiGLU starting
    on an odd number keeps w1 and w2, one starting on an even number keeps only w3 (the up output)."""
    return position % 2 == 1


def block_bytes_selective(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    """Op policy (every other matmul output of the block saved, counted in call order; ac.py): attention
    as the dense block (its four matmuls: q and v saved); the router's gate output (saved; softmax,
    top-k and the weights are recomputed); then the experts on CPU run three matmuls each, one expert
    after the other (experts.py `_looped`), so the saved ones alternate between experts: the first
    local expert keeps its up output (F), the second its gate and down outputs (F + h), and so on.
    Per routed copy that is F, plus h on every other local expert (half of them when they are even in
    number; balanced routing). The shared experts come after and follow the same parity. (The
    dense block's fourth saved matmul, its FFN's down output, has no counterpart here.)"""
    attn = dense.block_bytes_selective(_attention_only(d), e, tp, sp, autocast, compiled=True)
    # The grouped GEMM is one matmul for all experts (ac.py counts it once): like a single expert, it
    # starts on the 6th matmul and keeps only its up output, F per routed copy (measured with the
    # runtime's AC on CPU, tests/unit/test_moe_activations.py).
    local = 1 if d.grouped else max(1, d.experts // d.ep)
    first = _MATMULS_BEFORE_EXPERTS + 1
    with_down = sum(_saves_down(first + 3 * j) for j in range(local)) / local
    routed = d.routed_scale * d.top_k * e * (d.fe + with_down * d.h)
    shared = e * (d.fs + (d.h if _saves_down(first + 3 * local) else 0)) if d.fs else 0.0
    moe = e * d.experts + routed + shared
    # Dense blocks: the dense model's count (its down output included unless compiled).
    dense_ffn = dense.block_bytes_selective(_attention_only(d), e, tp, sp, autocast, compiled) - attn
    return attn + d.sparse * moe + (1 - d.sparse) * (e * d.f / tp + dense_ffn)


block_bytes, block_bytes_budget = dense.ac_policy_functions(block_bytes_no_ac, block_bytes_selective)


def backward_working_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """Inside a sparse block's backward: the residual gradient, the gradients of the combined and the
    grouped copies (k·h each), and the shared SwiGLU's two F-wide gradients."""
    moe = e * d.h + d.routed_scale * 2 * e * d.top_k * d.h + 2 * e * d.fs
    return d.sparse * moe + (1 - d.sparse) * dense.backward_working_bytes(d, e, tp)


def flash_backward_bytes(d: BlockDims, e: int, tp: int = 1) -> float | None:
    """Per token, CUDA's flash-attention backward: the dense block's (the same SDPA call on the same heads;
    dtlaunch.models.dense.activations.flash_backward_bytes), which the planner weighs against the FFN's
    backward above, the larger being the block's moment. None for attention sinks (gpt-oss: their own
    kernel)."""
    return dense.flash_backward_bytes(_attention_only(d), e, tp)


# training.mlp_tiles (dtlaunch.train.features.tiled_mlp, dtlaunch.plan.tiled_terms): the routed experts run over
# tiles of their routed copies, the shared experts and dense blocks' SwiGLU over tiles of the tokens.


def tiled_saved_bytes(d: BlockDims, e: int, tp: int, compiled: bool) -> float:
    """Per token: what the tiled MLPs do not save: the routed experts' four F-wide intermediates per
    copy, the shared SwiGLU's, and the dense blocks' (the dense model's count). Their inputs, the grouped
    copies and the norm output, stay saved (by the tiled function instead of the first matmuls)."""
    moe = d.routed_scale * glu_saves(d) * d.top_k * e * d.fe + 4 * e * d.fs
    return d.sparse * moe + (1 - d.sparse) * dense.tiled_saved_bytes(d, e, tp, compiled)


def tiled_working_bytes(d: BlockDims, e: int, tp: int, tiles: int) -> float:
    """Per token, the change to a block's backward working set: one tile of the routed copies recomputed at
    a time, its four F-wide intermediates and two F-wide gradients (6·e·F per copy over `tiles`; untiled,
    `backward_working_bytes` counts none of the routed experts' F-wide gradients); the shared and
    dense SwiGLUs as the dense block's (one tile, an input-gradient buffer, less the two F-wide gradients).
    The routed input-gradient buffer is the grouped copies' gradient, counted already."""
    routed = d.routed_scale * 6 * d.top_k * e * d.fe / tiles
    shared = (6 * e * d.fs / tiles + e * d.h - 2 * e * d.fs) if d.fs else 0.0
    return d.sparse * (routed + shared) + (1 - d.sparse) * dense.tiled_working_bytes(d, e, tp, tiles)


def tiled_grad_sum_elements(d: BlockDims, tp: int = 1) -> float:
    """Per block, the largest: the tiles' summed weight gradients of its MLPs, elements (a sparse block's
    local experts, E / ep of them, and shared experts; a dense block's SwiGLU)."""
    sparse = 3 * d.h * (d.experts // d.ep * d.fe + d.fs) if d.sparse else 0
    return max(sparse, dense.tiled_grad_sum_elements(d, tp) if d.sparse < 1 else 0)
