"""The last stage's logits and loss terms, for a full-vocabulary loss or a chunked one (training.loss_chunks).

Full pass (loss_chunks = 1): forward keeps the logits (compute dtype, referenced until backward returns)
and log_softmax's fp32 output; its backward adds nll's and log_softmax's fp32 gradients (the model
family's `logits_forward_bytes` / `logits_backward_bytes`).

Chunked, gradients taken in forward (dtlaunch/train/loss.py, LinearCrossEntropy; no tensor parallel, no pipeline):
`_fused_moment`. Chunked and recomputed (tensor parallel, a pipeline's last stage, the preference objectives' per-token
log-probs): forward keeps no logits at all (each chunk runs under
checkpointing and leaves only its loss). At a chunk's backward its logits are recomputed: log_softmax's
fp32 output, then nll's and log_softmax's fp32 gradients (one fused gradient under loss_parallel): what a
full pass holds, for 1/n of the tokens, less the logits it keeps referenced.
On top of it the head's weight gradient accumulates over the chunks: autograd adds each chunk's
contribution to the sum of the previous ones out of place, so three head-sized gradients exist for a
moment (in the dtype the head's matmul differentiates: the compute dtype under FSDP's mixed precision,
fp32 otherwise; none for a frozen head): with few tokens per chunk that, not the logits, is the peak.
Under autocast (one GPU, DDP) the chunks share autocast's one cached cast of the head, and their gradients
are summed in its backward, in place and in the compute dtype (`_autocast_moment`). Under ZeRO-3 the
loss gathers the root unit again (embedding included) for the head's weight; a frozen, untied head (LoRA /
QLoRA), and a trained untied head without TP, is an FSDP unit of its own instead, gathered for the loss only (ZeRO-2 and ZeRO-3). Under autocast each chunk's recompute also casts the head's weight to the compute dtype (the
cast is saved by the matmul until its backward, and its gradient is cast back to fp32); a frozen, untied
head is stored in the compute dtype already and is not cast. Under sequence
parallel the hidden states are gathered once for the loss and kept until backward.
"""

from __future__ import annotations

import math
from typing import Any

from dtlaunch.config.schema import ObjectiveName

# Measured corrections (each names the test that measures it; tests/unit/test_plan_corrections.py checks
# that the test exists and sees the term).
# Head-sized weight gradients at once when autograd adds a chunk's gradient to the sum of the earlier
# ones out of place: sum, contribution and new sum (StorageCounter on CPU).
# Measured by tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace (the pipeline's last stage)
HEAD_GRAD_SUM_COPIES = 3
# A head unit of its own gathered for the fused loss: FSDP2 keeps the forward's all-gather output until
# the next unit's copy-out, so the gathered weight is there twice (LoRA ZeRO-3 and full fine-tuning
# ZeRO-2 / ZeRO-3 on real gloo runs).
# Measured by tests/unit/test_plan_peft.py::test_head_unit_plan_within_5_percent_of_trace
HEAD_UNIT_GATHERED_COPIES = 2


def loss_chunks(c: Any) -> int:
    """Token chunks of this stage's loss (1 where the stage has no head)."""
    return c.decisions.loss_chunks if c.last_stage else 1


def logits_saved_per_token(c: Any) -> float:
    """Bytes per token the loss keeps from forward to backward (beyond the final norm's)."""
    if not c.last_stage:
        return 0.0
    if loss_chunks(c) == 1:
        return c.activation_model.logits_forward_bytes(c.block_dims, c.compute_bytes, c.tp)
    # The gathered (full-sequence) hidden states of sequence parallel, saved by the chunks' matmuls.
    return c.compute_bytes * c.block_dims.h if c.sequence_parallel else 0.0


def held_logits(c: Any) -> float:
    """The logits the micro-step keeps referenced until backward returns (a full pass only)."""
    if not c.last_stage or loss_chunks(c) > 1:
        return 0.0
    return c.compute_bytes * c.block_dims.vocab / c.tp * c.tokens


def loss_backward_bytes(c: Any) -> float:
    """What the loss's backward adds on top of what forward kept, at its largest moment."""
    if not c.last_stage:
        return 0.0
    n = loss_chunks(c)
    if n == 1:
        return c.activation_model.logits_backward_bytes(c.block_dims, c.compute_bytes, c.tp) * c.tokens
    e, v = c.compute_bytes, c.block_dims.vocab / c.tp
    chunk_tokens = math.ceil(c.tokens / n)
    head = c.block_dims.h * v
    if fused(c):
        return _fused_moment(c, chunk_tokens, head)
    if c.autocast and c.peft is None and c.tp == 1 and not c.fsdp and not c.tied_head:
        # (A tied head's gradient meets the embedding's fp32 one after the blocks' backward: Qwen3-0.6B, one
        # sequence, is 5 % under its trace with this moment, 1 % with the one below.)
        return _autocast_moment(c, v, chunk_tokens, head)
    grad = 0.0 if c.peft is not None else (e if c.fsdp else 4) * head  # one head-sized weight gradient
    # At a chunk's log_softmax backward: its fp32 output and the two fp32 gradients, next to the head's
    # gradient summed over the earlier chunks; then autograd adds the chunk's new weight gradient to
    # that sum out of place: sum, contribution and new sum (measured with StorageCounter on CPU).
    # Under tensor parallel, loss_parallel's backward computes softmax - one-hot in one step: one fp32
    # gradient, not two.
    at_softmax = (12 if c.tp == 1 else 8) * v * chunk_tokens
    moment = max(at_softmax + grad, HEAD_GRAD_SUM_COPIES * grad)
    if c.fsdp and c.head_unit:
        moment += e * head  # the head's own unit, gathered by the loss (ZeRO-2 and ZeRO-3)
    elif c.fsdp and c.zero_stage == 3 and c.first_stage:
        moment += e * head  # the root unit gathered again for the loss brings the embedding back too
    if c.autocast and (c.peft is None or c.tied_head):
        # The chunk's cast of the head's weight, saved by its matmul; a frozen, untied head is stored in the
        # compute dtype already (train.parallel.frozen_base): nothing to cast. Measured by
        # tests/unit/test_plan_vs_h200.py::test_plan_within_3_percent_of_the_h200 (GRPO with LoRA)
        moment += e * head
    return moment


def _autocast_moment(c: Any, v: float, chunk_tokens: int, head: float) -> float:
    """The recomputed chunks' largest moment for a trained, untied head under autocast (one GPU, DDP): autocast casts
    the fp32 head to the compute dtype once in forward and caches the cast, so every chunk's weight gradient
    meets the others in that one cast's backward and is summed there, in place and in the compute dtype;
    the fp32 gradient is made once, after the last chunk. Two moments: at a chunk's log_softmax backward,
    its three fp32 (T, V) buffers and its logits next to the summed gradient and the chunk's recomputed cast
    of the weight; at its weight gradient, the sum, the new contribution and the cast, with the logits'
    gradient; then the sum's cast to fp32 beside it. In bf16, per head parameter and per vocabulary-token
    of a chunk: 4 + 14 and 6 + 4 bytes (StorageCounter on CPU); without the cache (fp32, below) three fp32
    gradients. On an H200, GRPO's full fine-tune: +12.3 % with three fp32 gradients, +0.9 % with this.
    Measured by tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace_at_real_sizes"""
    e = c.compute_bytes
    at_softmax = (12 + e) * v * chunk_tokens + 2 * e * head
    at_weight_grad = 3 * e * head + 2 * e * v * chunk_tokens
    return max(at_softmax, at_weight_grad, (e + 4) * head)


def fused(c: Any) -> bool:
    """Whether the chunks' gradients are taken in forward (dtlaunch.train.loss.LinearCrossEntropy): plain tensors
    (no tensor parallel), no pipeline (dtlaunch.train.loss.head_loss), and the next-token loss (a
    preference objective's per-token log-probs are recomputed: their gradient waits for every row's sum)."""
    return c.tp == 1 and getattr(c, "pp", 1) == 1 and c.cfg.objective.name == ObjectiveName.sft


def _fused_moment(c: Any, chunk_tokens: int, head: float) -> float:
    """The fused loss's largest moment: in forward, one chunk's fp32 logits (softmax and its gradient are
    made in their storage; in bf16 the matmul's output and the gradient's cast exist next to them for a
    moment) next to the head's weight gradient accumulated in place in the matmul's dtype and, under
    autocast, the head's weight cast to it; or, at backward, that gradient cast to the fp32 parameter's.
    The hidden states' gradient (held from forward to backward) takes the place of the final norm's output,
    which nothing saves now. Measured with StorageCounter on CPU (tests/unit/test_chunked_loss.py)."""
    e = c.compute_bytes
    trained = c.peft is None
    grad = (e if (c.fsdp or c.autocast) else 4) * head if trained else 0.0
    cast = e * head if c.autocast and trained else 0.0
    at_chunk = (4 + (e if e != 4 else 0)) * c.block_dims.vocab * chunk_tokens
    moment = max(at_chunk + grad + cast, grad + (4 * head if cast else 0.0))
    if c.fsdp and c.head_unit:
        # The head's own unit (frozen, or trained: dtlaunch.train.parallel.head_unit), gathered for the loss
        # (ZeRO-2 and ZeRO-3), which runs as the unit's forward: FSDP2 keeps the forward's all-gather output
        # until the next unit's copy-out (the first in backward): HEAD_UNIT_GATHERED_COPIES.
        moment += HEAD_UNIT_GATHERED_COPIES * e * head
    elif c.fsdp and c.zero_stage == 3 and c.first_stage and trained:
        # The root unit gathered again for the loss brings the embedding back too (a frozen embedding is a
        # unit of its own: measured, LoRA ZeRO-3 on real gloo runs, nothing comes back).
        moment += e * head
    return moment


def regathered_root(c: Any) -> float:
    """Under ZeRO-3 x TP the chunked loss's gather of the root unit (HeadLoss) stays, embedding included,
    through the blocks' backward until the root's post-backward. Traced (planner7m, 8 ranks): FSDP(4) x
    TP(2) with full AC was 5 % under without it; plain ZeRO-3 (bf16) is within 3.5 % without it and 6 %
    over with it, as for the full loss, whose re-gathered embedding does not add either (static_lines)."""
    if loss_chunks(c) == 1 or not (c.fsdp and c.zero_stage == 3 and c.first_stage and c.tp > 1) or c.head_unit:
        return 0.0  # (a head's own unit is gathered for the loss alone, the root is not)
    if c.peft and c.blocks_without_ac == 0:
        return 0.0  # the fine-tuning term already holds the gathered embedding (dtlaunch.plan.stage)
    return c.compute_bytes * c.vocab_params
