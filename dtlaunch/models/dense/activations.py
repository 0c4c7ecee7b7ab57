"""Saved-activation bytes per token of the dense decoder block (dtlaunch/models/dense/model.py), op by op.

What eager autograd keeps between forward and backward, per token of one micro-batch (e = bytes of
the compute dtype, h = dim, k = kv-heads * head_dim, F = FFN width, a = heads):

RMSNorm (dtlaunch.models.dense.norm: a Function that keeps its input and rsqrt, and recomputes the
    normalised value in backward): the input, e·h (for the attention norm that is the block input;
    for the FFN norm the residual h1, which nothing else keeps), and rsqrt, 4 bytes; its output, e·h,
    is saved by the next linear. -> 2e·h + 4 per norm.
Attention: wq/wk/wv share the norm output (counted above); RoPE multiplies by constant cos/sin so
    it saves no input, only its outputs q_rot (e·h) and k_rot (e·k) that SDPA keeps; SDPA keeps v
    (e·k), its output (e·h; laid out so that transpose+reshape into wo is a view) and a logsumexp
    (4a). On CPU torch runs `_scaled_dot_product_flash_attention_for_cpu` for fp32 and bf16 (also
    with GQA), which saves no (s x s) matrix; the math fallback would add 4·a·s per token (noted).
Attention sinks (gpt-oss, sink_attention): SDPA runs on q, k, v widened by `sink_dims` head dims (and one
    more row each), so it keeps those copies and its widened output; wo saves the output cut back to
    head_dim (a copy, e·h). Measured like the rest (tests/unit/test_moe_activations.py), exact but for the
    extra row's 1/seq share.
SwiGLU: w1 out, silu out, w3 out, their product (w2's input): 4·e·F.
Residual adds save nothing; the residual h1 is ffn_norm's saved input (counted there).

Per block, no AC: 2·(2eh + 4) + e·(2h + 2k + 4F) + 4a (h stands for the query width
n_heads·head_dim in the attention terms; it differs from dim when head_dim is set, as on Qwen3).
Per-head q/k RMSNorm (Qwen3): each keeps its input (the projection's output) and one rsqrt per head;
its output goes to RoPE, which saves no input: e·(q + k) + 4·(a + kv heads). Over the whole projection
(OLMo's qk_norm_whole): one rsqrt per token each, e·(q + k) + 8.
Post-norm blocks (OLMo: the norms act on the attention and MLP outputs): wq/wk/wv save the block input
and w1/w3 the residual h1 instead of a norm's output, and each norm keeps its input (the wo / w2 output)
and rsqrt while its output is only added to the stream: the same 2e·h + 4 per norm. Measured with the
runtime's StorageCounter on tiny blocks (fp32 and bf16, no AC / selective / full): exact. Under autocast
the norms' inputs are the bf16 matmul outputs (e·h, not the fp32 stream's 4h), and wq/wk/wv, w1/w3 still
save their own casts of the stream: measured the same way, exact.
Sandwich norms (Gemma: a norm on the wo and w2 outputs as well as the two before the sublayers): each
extra norm keeps its input (that output, compute dtype under autocast too) and rsqrt, e·h + 4; its output
is only added to the stream. GELU-tanh saves its input as SiLU does. Gemma's q/k norms return the compute
dtype, so under autocast RoPE's table casts are real copies (the planner's separate rope-cast line).
Measured like OLMo's (tests/unit/test_dense_activations.py): exact.
Tensor parallel degree t (heads and F sharded): the attention/MLP terms divide by t. Sequence
parallel (t > 1) also shards the norms' sequence, but the all-gathered norm output saved by the
column-parallel linears is full: norms give (eh + 4)/t + eh each.
Selective AC, op policy (dtlaunch.train.parallel.ac: attention and every other matmul saved, the 1st, 3rd, ...
of the block): block input + wq, wv, w1, w2 outputs + SDPA out and logsumexp; wk, wo, w3 and
everything elementwise are recomputed.
Selective AC, layer policy: every n-th block is fully checkpointed, the others keep their no-AC set.
Full AC: the block input only; during backward one block's no-AC set is live again (recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dtlaunch.models.dense.shapes import ffn_dim, head_dim, kv_heads, sink_dims
from dtlaunch.models.dtypes import DTYPE_BYTES  # noqa: F401 (planner code reads it here too)

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig, TrainingConfig


@dataclass(frozen=True)
class BlockDims:
    h: int
    k: int  # kv width = kv_heads * head_dim
    f: int
    a: int
    vocab: int
    q: int = 0  # query width = n_heads * head_dim (0: equal to h)
    qk_norm: bool = False
    hd: int = 0  # head_dim (0: h // a)
    qk_norm_whole: bool = False  # the q/k norm spans the whole projection (one rsqrt per token)
    post_norm: bool = False  # the block norms act on the sublayer outputs (OLMo)
    sandwich: bool = False  # two more norms, on the sublayer outputs (Gemma's sandwich_norm)
    rope_tables: int = 1  # RoPE table sets (Gemma 3: global and local bases side by side)
    sink_dims: int = 0  # head dims the attention-sink kernel adds (gpt-oss; 0: no sinks)

    @classmethod
    def of(cls, m: ModelConfig) -> BlockDims:
        return cls(
            h=m.dim,
            k=kv_heads(m) * head_dim(m),
            f=ffn_dim(m),
            a=m.n_heads,
            vocab=m.vocab_size,
            q=m.n_heads * head_dim(m),
            qk_norm=bool(getattr(m, "qk_norm", False)),
            hd=head_dim(m),
            qk_norm_whole=bool(getattr(m, "qk_norm_whole", False)),
            post_norm=bool(getattr(m, "post_norm", False)),
            sandwich=bool(getattr(m, "sandwich_norm", False)),
            rope_tables=2 if getattr(m, "rope_local_theta", None) is not None else 1,
            sink_dims=sink_dims(m),
        )

    @property
    def qw(self) -> int:
        return self.q or self.h

    @property
    def head(self) -> int:
        return self.hd or self.h // self.a

    @property
    def rope_columns(self) -> int:
        """Columns of each RoPE table: head_dim / 2 per base."""
        return self.head // 2 * self.rope_tables


def norm_bytes(d: BlockDims, e: int, tp: int, sp: bool, autocast: bool = False, consumers: int = 1) -> float:
    """One RMSNorm's saved bytes per token: its input and rsqrt (sequence-sharded under sequence
    parallel), and the output its readers save.

    Under autocast the residual stream stays fp32: the norm keeps its fp32 input, and each of its
    `consumers` linears saves its OWN compute-dtype cast of the fp32 output (3 for wq/wk/wv, 2 for
    w1/w3; measured with saved-tensor hooks). A post-norm (OLMo) reads a matmul's output, in the compute
    dtype under autocast too, and its readers (the same linears) save their casts of the fp32 stream."""
    own = ((4 if autocast and not d.post_norm else e) * d.h + 4) / (tp if tp > 1 and sp else 1)
    return own + (consumers if autocast else 1) * e * d.h


def block_bytes_no_ac(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    attn = e * (2 * d.qw + 2 * d.k) + 4 * d.a
    if d.sink_dims:
        # Attention sinks (sink_attention): SDPA keeps its widened q, k, v and output, and wo its input, the
        # output cut back to head_dim (a copy). Each operand also has one more row (the dummy query, the
        # sink key): a 1/seq share the planner leaves out.
        w = d.head + d.sink_dims
        attn = e * (2 * d.a * w + 2 * (d.k // d.head) * w + d.qw) + 4 * d.a
    if d.qk_norm:
        attn += e * (d.qw + d.k) + (8 if d.qk_norm_whole else 4 * (d.a + d.k // d.head))
    mlp = 4 * e * d.f
    norms = norm_bytes(d, e, tp, sp, autocast, 3) + norm_bytes(d, e, tp, sp, autocast, 2)
    if d.sandwich:
        # Gemma's norms on the wo and w2 outputs keep those (compute dtype, autocast too) and rsqrt; their
        # outputs are only added to the stream.
        norms += 2 * (e * d.h + 4) / (tp if tp > 1 and sp else 1)
    if compiled:
        # Inductor's partitioner recomputes cheap pointwise values from what it saves anyway: SwiGLU's
        # SiLU output (e·F) is not saved. Measured with saved-tensor hooks on compiled CPU blocks (fp32
        # and bf16, two shapes): exact.
        mlp -= e * d.f
    return norms + (attn + mlp) / tp


def block_input_bytes(d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False) -> float:
    """The residual stream entering a block (what a checkpointed block keeps); fp32 under autocast."""
    return (4 if autocast else e) * d.h / (tp if tp > 1 and sp else 1)


def block_bytes_selective(
    d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
) -> float:
    # Op policy: saved matmul outputs q (h), v (k), w1 (F), w2 (h, reduced to the residual, so
    # sequence-sharded under SP); SDPA output (h) + logsumexp. Compiled, w2's output is not kept: eager
    # SAC stores every must-save output, the compiled graph only those backward reads (the residual
    # add's backward reads none). Measured on compiled CPU blocks.
    sharded = e * (2 * d.qw + d.k + d.f) + 4 * d.a
    if d.sink_dims:  # attention sinks: SDPA's output is widened (sink_attention; its extra row left out)
        sharded += e * d.a * d.sink_dims
    residual_mm = 0.0 if compiled else e * d.h / (tp if tp > 1 and sp else 1)
    return block_input_bytes(d, e, tp, sp, autocast) + sharded / tp + residual_mm


def ac_mix(t: TrainingConfig, layer_ids: Sequence[int]) -> dict[str, int]:
    """How many of a stage's blocks run under each checkpointing kind ("none", "full", "selective",
    "budget"). The layer policy checkpoints the every-th, 2·every-th, ... block by global index, the
    rule of dtlaunch.train.parallel.ac.checkpointed_layer (not imported: the planner does not import torch)."""
    mode, n = t.activation_checkpointing, len(layer_ids)
    if mode == "selective" and float(t.ac_memory_budget) > 0:
        return {"budget": n}
    if mode == "selective" and t.ac_policy == "layer":
        every = int(t.ac_every_n_layers)
        ckpt = sum(1 for i in layer_ids if (i + 1) % every == 0)
        return {"full": ckpt, "none": n - ckpt}
    return {mode: n}


def ac_policy_functions(
    no_ac: Callable[..., float], selective: Callable[..., float]
) -> tuple[Callable[..., float], ...]:
    """`block_bytes` and `block_bytes_budget` for a family, from its own no-AC and
    selective models: full AC and the budget partitioner work the same way for every block."""

    def block_bytes_budget(
        d: Any, e: int, budget: float, tp: int = 1, sp: bool = False, autocast: bool = False
    ) -> float:
        """Compile's memory-budget partitioner keeps `budget` of what the graph would save without AC,
        on top of the block input it always keeps."""
        keep = block_input_bytes(d, e, tp, sp, autocast)
        return keep + budget * (no_ac(d, e, tp, sp, autocast, compiled=True) - keep)

    def block_bytes(
        d: Any, e: int, ac: str, tp: int = 1, sp: bool = False, autocast: bool = False, compiled: bool = False
    ) -> float:
        """Bytes per token one block keeps from its forward until its backward (`compiled`: training.compile)."""
        if ac == "full":
            return block_input_bytes(d, e, tp, sp, autocast)
        if ac == "selective":
            return selective(d, e, tp, sp, autocast, compiled)
        return no_ac(d, e, tp, sp, autocast, compiled)

    return block_bytes, block_bytes_budget


block_bytes, block_bytes_budget = ac_policy_functions(block_bytes_no_ac, block_bytes_selective)


def backward_working_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """Activation gradients live inside one block's backward: the residual gradient and the two
    F-wide gradients of SwiGLU (w1/w3 outputs) at once."""
    return e * d.h + 2 * e * d.f / tp


def flash_backward_bytes(d: BlockDims, e: int, tp: int = 1) -> float | None:
    """Per token, what lives while CUDA's flash-attention kernel runs its backward (torch's SDPA on a GPU):
    the residual gradient (as `backward_working_bytes`), the gradient of SDPA's output, dq, dk and dv, the
    kernel's fp32 dq accumulator and, with grouped K/V heads, dk and dv expanded to the query heads before
    their sum. At long context with tiled MLPs this, not the MLP, is the block's largest backward moment:
    131,072 tokens of Llama-3.1-8B on an H200 allocated 48.1 GiB against a plan of 42.7 without it. None
    for attention sinks (their own kernel)."""
    if d.sink_dims:
        return None
    q = d.qw / tp
    grouped = 2 * e * q if d.k != d.qw else 0.0
    return e * d.h + e * q + e * (q + 2 * d.k / tp) + 4 * q + grouped


# training.mlp_tiles (dtlaunch.train.features.tiled_mlp; how the plan uses these: dtlaunch.plan.tiled_terms).


def tiled_saved_bytes(d: BlockDims, e: int, tp: int, compiled: bool) -> float:
    """Per token: what the untiled SwiGLU saves for backward and the tiled one does not (w1, SiLU, w3 and
    their product; compiled, Inductor drops the SiLU output)."""
    return (3 if compiled else 4) * e * d.f / tp


def tiled_working_bytes(d: BlockDims, e: int, tp: int, tiles: int) -> float:
    """Per token, the change to the block's backward working set: one tile's recompute and gradients
    (6·e·F over `tiles`) and the input-gradient buffer (e·h), less the untiled F-wide gradients (2·e·F)."""
    return 6 * e * d.f / (tp * tiles) + e * d.h - 2 * e * d.f / tp


def tiled_grad_sum_elements(d: BlockDims, tp: int = 1) -> float:
    """Per block: the tiles' summed SwiGLU weight gradients, elements."""
    return 3 * d.h * d.f / tp


def rope_cast_bytes(d: BlockDims, e: int, seq: int) -> float:
    """Per block and micro-batch: RoPE casts its fp32 cos/sin tables to the compute dtype for q and
    k (4 tables of seq x head_dim/2, saved by the rotations; with two bases a block casts its own half);
    nothing in fp32 (no-op cast)."""
    return 0.0 if e == 4 else 4 * seq * (d.head // 2) * e


def final_norm_bytes(d: BlockDims, e: int, tp: int = 1, sp: bool = False, autocast: bool = False) -> float:
    return norm_bytes(d, e, tp, sp, autocast, 1)


def embedding_bytes(d: BlockDims, e: int) -> float:
    """The int64 token ids the embedding keeps for its backward."""
    return 8.0


def logits_forward_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """Per token, kept from the loss until backward: log_softmax's fp32 output (cross entropy is
    computed on `logits.float()`) and the logits themselves (compute dtype), which the runtime's
    micro-step keeps referenced until backward has finished (dtlaunch.train.step._micro_step)."""
    return (4 + e) * d.vocab / tp


def logits_backward_bytes(d: BlockDims, e: int, tp: int = 1) -> float:
    """Per token at log_softmax's backward, on top of what forward kept: nll's dense fp32 gradient
    and log_softmax's fp32 input-gradient (the cast back to the logits dtype comes after both of
    the first two are freed, so it never adds to this).

    Under TP the loss runs in torch's loss_parallel, whose nll backward also does log_softmax's (the
    latter passes its gradient through): one fp32 vocabulary shard. Real 2-process gloo runs of a
    32k-vocabulary model at TP 2 (fp32 and bf16) peak exactly there; counting two put them 12-23 %
    over."""
    return (4 if tp > 1 else 8) * d.vocab / tp
