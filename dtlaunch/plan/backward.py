"""The backward phase of one stage's plan: the largest of its moments.

PLACEHOLDER
"""

from __future__ import annotations

from dtlaunch.plan import offload
from dtlaunch.plan.hardware import gloo_collectives
from dtlaunch.plan.loss_terms import held_logits, loss_backward_bytes, regathered_root
from dtlaunch.plan.peft import gathered_block
from dtlaunch.plan.ring_terms import backward_exchange_bytes, sequence_tokens
from dtlaunch.plan.shape import StageShape, loss_saved_per_token, mean_block_saved_per_token
from dtlaunch.plan.tiled_terms import grad_sum_bytes, mlp_saved_bytes, tile_working_bytes, tiled


def backward_peak(c: StageShape, lines: dict[str, float]) -> float:
    """The largest backward moment, given the static and forward lines."""
    d, e, r, tp, layers, tokens = c.block_dims, c.compute_bytes, c.reduce_bytes, c.tp, c.layers, c.tokens
    fsdp, zero, first, last = c.fsdp, c.zero_stage, c.first_stage, c.last_stage
    div = c.shard_ranks if fsdp else 1
    in_backward = bool(c.optim and c.optim.in_backward)
    base = sum(lines.values())
    # Blocks' saved bytes per token still on the device (training.activation_offload moves the rest).
    blk_tok = mean_block_saved_per_token(c) - (offload.moved_per_token(c) / layers if layers else 0.0)
    # Two moments: (1) log_softmax's backward on the last stage (everything forward kept + the fp32 loss
    # gradients), (2) inside a block's backward: its recompute set, activation gradients, its unsharded
    # parameters (+ the prefetched next block) and gradients, and the gradients already produced. (2) is
    # taken at the first block processed (most activations still held) and at the last (most gradients
    # produced).
    loss_bwd = loss_backward_bytes(c)  # full or chunked loss (dtlaunch.plan.loss_terms)
    head_grads = (4 * (c.vocab_params + d.h) if last else 0.0) / div
    unit = 0.0
    if fsdp:
        # The block being differentiated: its gathered parameters (ZeRO-3) and unsharded gradients
        # (+ their reduce-dtype copy). Measured: the prefetched next block does not add at the peak.
        unit = (e * c.gathered_block_params if zero == 3 else 0.0) + (
            e + (r if r != e else 0)
        ) * c.gathered_block_params
        unit += offload.staging_bytes(c)  # CPU offload: the unit's fp32 shard copied in to be gathered
        head_grads = (e * (c.vocab_params + d.h) if last else 0.0) if zero == 3 else head_grads
        if c.trained_head_unit:
            # The head's gradient was reduce-scattered at its unit's post-backward, right after the loss's
            # backward: its shard stays; the final norm's unsharded gradient waits for the root's.
            head_grads = c.head_grad_shard_bytes + (e * d.h if zero == 3 else 4 * d.h / div)
        if c.peft:
            gathered = gathered_block(c.peft, c.gathered_block_params, e) if zero == 3 else 0.0
            unit = gathered + (e + (r if r != e else 0)) * c.trained_block_params
    if c.peft:
        head_grads = 0.0  # the head and final norm are frozen
    # The block being recomputed: the most any checkpointed kind of this stage re-creates at once.
    none_tok = c.activation_model.block_bytes_no_ac(d, e, tp, c.sequence_parallel, c.autocast, c.compiled)
    recompute = max(
        (none_tok - c.block_saved_per_token[k] for k in c.ac_mix if k != "none" and c.ac_mix[k]), default=0.0
    )
    work = (c.activation_model.backward_working_bytes(d, e, tp) + recompute) * tokens
    if tiled(c.activation_model, c.mlp_tiles):  # dtlaunch.plan.tiled_terms
        none_tok -= mlp_saved_bytes(d, e, tp, c.compiled)
        recompute = max(
            (none_tok - c.block_saved_per_token[k] for k in c.ac_mix if k != "none" and c.ac_mix[k]), default=0.0
        )
        grads = c.activation_model.backward_working_bytes(d, e, tp) + tile_working_bytes(d, e, tp, c.mlp_tiles)
        work = (grads + recompute) * tokens + grad_sum_bytes(d, c.grad_element_bytes, tp, not c.peft)
    if c.peft and c.peft.qlora:
        work += c.peft.dequant  # one NF4 weight dequantised for its matmul
    if c.cp > 1:
        # Every row of the micro-batch (a preference pair is two: real 2-rank gloo DPO runs, CP(2), were
        # 3 % under with the exchange of one row per sample).
        work += backward_exchange_bytes(d, e, tp, sequence_tokens(c))
    if c.autocast and c.blocks_without_ac < layers:
        work += e * (
            c.peft.adapters_block if c.peft else c.block_params - c.block_norm_params
        )  # the recomputed block casts its weights
    # The loss backward frees the final norm's and log_softmax's saved tensors of its own micro-batch
    # only: under a pipeline the other micro-batches in flight keep theirs. (Subtracting them for every
    # micro-batch in flight put GPipe's last stage 13 % under real gloo runs.)
    held_act = lines["activations"] - (loss_saved_per_token(c) * tokens if last else 0.0)
    held_act += held_logits(c)  # a full pass's logits stay referenced until backward returns
    blk_grads = (c.grad_element_bytes * c.trained_block_params / div) if layers else 0.0
    if offload.cpu_offload(c) and c.accum_steps == 1:
        # Each block's gradient shard becomes the host gradient as its reduce-scatter ends (with
        # accumulation it stays on the device until it is added into the host's: measured on gloo runs).
        blk_grads = 0.0
    at_first_blk = base - lines["activations"] + held_act + head_grads + unit + work + blk_grads
    at_first_blk += offload.reloaded_block(c)  # activation offload: the block's saved set back from the host
    at_first_blk += regathered_root(c)  # a chunked loss's gather of the root unit (dtlaunch.plan.loss_terms)
    if c.peft and fsdp and zero == 3 and layers > 1:
        # Fine-tuning: the next block's unit, prefetched by the block's pre-backward (FSDP2 gathers the
        # unit that ran before it in forward), is already gathered at the first block's peak: a traced
        # CPU run (`plan --trace`, planner7m LoRA / QLoRA ZeRO-3) has one gathered block in "Unsharded
        # Param" and one in "All Gather". (Full training's larger gradients put its peak after the
        # prefetch is consumed.) The frozen embedding's unit is prefetched only by the last block
        # processed, when the activations are gone, and the frozen head's after the loss: neither adds.
        # Under expert parallel the traced peak (planner_moe LoRA ZeRO-3, EP 2) holds one gathered block
        # and nothing in "All Gather": counting the prefetch put the real run 5 % over.
        at_first_blk += gathered_block(c.peft, c.gathered_block_params, e) if c.ep == 1 else 0.0
    # Gradients produced since the first block: with accumulation they already exist from the earlier
    # micro-steps (the "accumulated gradients" line) and are added into in place, so nothing grows.
    # (Counting them again put Llama-3.1-70B FSDP x TP, 16 micro-steps, 12 % over its trace.)
    # (Under CPU offload each block's gradient shard leaves for the host: nothing grows on the device.)
    grows = c.accum_steps == 1 and not offload.cpu_offload(c) and not in_backward
    grown = max(0, layers - 1) * blk_grads if grows else 0.0
    if in_backward:
        # The update of one tensor runs inside backward, its gradient freed right after: a block's inside
        # the block's backward, the root unit's (embedding, head) after the last block's.
        at_first_blk += c.optim.temp_block
    at_last_blk = at_first_blk - (layers - 1) * blk_tok * tokens * c.microbatches_in_flight + grown
    if c.trained_head_unit:
        # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward: the head's stays
        # through the first block's backward (traced, Llama-3.1-8B ZeRO-3: 6 % under without it).
        at_first_blk += c.reduce_bytes * c.vocab_params
    if in_backward:
        at_last_blk += c.optim.temp - c.optim.temp_block
    if first and fsdp and zero == 3 and not c.peft:  # (a frozen embedding has no gradient)
        at_last_blk += e * c.vocab_params  # the embedding's unsharded gradient before its reduce-scatter
    elif first and c.accum_steps == 1 and not c.peft:
        at_last_blk += 4 * c.vocab_params / div
    backward = [base + loss_bwd, at_first_blk if layers else 0.0, at_last_blk if layers else 0.0]
    backward.append(_root_reduce_moment(c, lines, layers * blk_grads if grows else 0.0))
    backward.append(_head_reduce_moment(c, base))
    if c.pp > 1 and c.pp_microbatches > 1:
        backward += _later_microbatch_moments(c, lines, base, loss_bwd, at_first_blk, blk_grads, head_grads, blk_tok)
    return max(backward)


def _root_reduce_moment(c: StageShape, lines: dict[str, float], block_grads: float) -> float:
    """FSDP's reduce-scatter of the root unit (embedding, final norm, head) at the end of backward. Every
    activation is freed by then and the blocks' gradient shards exist (`block_grads`, when they grow in
    this micro-step). The root's unsharded gradients are copied into a flat reduce-dtype input (e + r
    bytes per parameter), then that input sits next to its reduce-dtype output shard (r + r / shard);
    gloo's reduce-scatter (a CPU profile) copies its input once more, NCCL does not. A frozen root (LoRA)
    has no gradient. With a full-vocabulary loss this is seldom the peak; with the chunked loss, whose
    gradients are taken in forward, it can be."""
    if not (c.fsdp and c.root_params and c.peft is None):
        return 0.0
    root = c.root_params - (c.vocab_params if c.trained_head_unit else 0)  # the head's own unit was reduced already
    static = sum(lines.values()) - lines["activations"] + c.head_grad_shard_bytes
    if c.zero_stage == 2:
        # ZeRO-2's blocks were resharded after their own backward: what stays gathered is what ZeRO-3
        # holds, the root's head and final norm (measured: the embedding's gathered copy does not add).
        held = c.compute_bytes * (root - (c.vocab_params if c.first_stage else 0))
        static -= max(0.0, lines.get("unsharded parameters", 0.0) - held)
    return static + block_grads + _reduce_per_param(c) * root


def _reduce_per_param(c: StageShape) -> float:
    """Bytes per parameter at an FSDP unit's reduce-scatter: its unsharded gradients copied into a flat
    reduce-dtype input (e + r), then that input next to its output shard (r + r / shard); gloo's
    reduce-scatter (a CPU profile) copies its input once more, NCCL does not."""
    gloo = gloo_collectives(c.cfg.hardware)
    return max(
        c.compute_bytes + c.reduce_bytes,
        c.reduce_bytes + c.reduce_bytes / c.shard_ranks + (c.reduce_bytes if gloo else 0),
    )


def _head_reduce_moment(c: StageShape, base: float) -> float:
    """The trained head unit's reduce-scatter at its post-backward, right after the loss's backward
    (dtlaunch.train.parallel.head_unit): everything forward kept (the blocks' activations, the hidden
    states' gradient), under ZeRO-3 a second head-sized all-gather buffer (the gathered weight itself is
    resharded just before the reduce-scatter), its unsharded gradient, the flat reduce-dtype
    input and output shard (+ gloo's copy of the input on a CPU profile). Traced (Llama-3.1-8B ZeRO-3,
    tiny 32k-vocabulary ZeRO-2 / ZeRO-3): FSDP2 frees the unsharded gradient only after the
    reduce-scatter is issued."""
    if not c.trained_head_unit:
        return 0.0
    gloo = gloo_collectives(c.cfg.hardware)
    buffer = c.compute_bytes if c.zero_stage == 3 else 0
    return (
        base
        + (buffer + c.compute_bytes + c.reduce_bytes + c.reduce_bytes / c.shard_ranks + (c.reduce_bytes if gloo else 0))
        * c.vocab_params
    )


def _later_microbatch_moments(
    c: StageShape,
    lines: dict[str, float],
    base: float,
    loss_bwd: float,
    at_first_blk: float,
    blk_grads: float,
    head_grads: float,
    blk_tok: float,
) -> list[float]:
    """A later pipeline micro-batch's backward: the stage's gradients are all allocated by the earlier ones
    while the schedule still holds its in-flight activations (1F1B: the same count as in warm-up; GPipe:
    one fewer). Measured on real 1F1B runs: this, not the first backward, is stage 0's peak."""
    s, e, r, layers, tokens, zero = c.cfg.strategy, c.compute_bytes, c.reduce_bytes, c.layers, c.tokens, c.zero_stage
    per_mb = lines["activations"] / c.microbatches_in_flight
    fewer = per_mb if c.microbatches_in_flight >= c.pp_microbatches else 0.0
    # 1F1B's steady state runs a forward between two backwards, which reshards the blocks (ZeRO-3);
    # GPipe's backwards follow one another, so what a backward left gathered stays gathered.
    fresh = c.microbatches_in_flight < c.pp_microbatches
    all_grads = c.gradient_bytes if c.accum_steps == 1 else 0.0  # with accumulation they are in `base` already
    gathered = in_unit = 0.0
    moments: list[float] = []
    # strategy.pp_reshard_grads=true: every micro-batch's backward reduce-scatters block by block as a
    # non-pipelined FSDP micro-step does, so the later micro-batches only add to sharded gradients.
    if c.fsdp and not s.pp_reshard_grads:
        # torch's pipeline stage turns FSDP's gradient sync and resharding off for every micro-batch
        # but the last: the whole stage's gradients accumulate unsharded (reduce dtype) and its
        # parameters stay gathered (ZeRO-3). They include the block in flight (`unit`), bar the
        # compute-dtype gradient it has just produced. Measured: Llama-3.1-8B FSDP(2) x PP(4)
        # stage 0 was 23 % under its trace without this.
        gathered = e * c.gathered_params - lines.get("unsharded parameters", 0.0) if zero == 3 else 0.0
        # `unit` holds the block's gathered parameters (in `gathered`), the compute-dtype gradient it
        # has just produced (a transient before it is added in) and, with a reduce dtype other than
        # the compute dtype, the accumulated copy (in r * p_gather). Measured (fake-tensor trace,
        # planner7m FSDP(2) x PP(2), 1F1B, fp32): the transient is in the peak.
        in_unit = (e * c.gathered_block_params if zero == 3 else 0.0) + (r * c.gathered_block_params if r != e else 0.0)
        all_grads = r * c.gathered_params + gathered - (in_unit if layers else 0.0)
        if layers:
            # The first micro-batch's backward at its last block: every block before it left its
            # unsharded gradients and (ZeRO-3) its gathered parameters. Measured (real gloo runs,
            # planner7m FSDP(2) x PP(2), GPipe): the last stage's peak (13 % under without it).
            kept = r * c.gathered_block_params + (e * c.gathered_block_params if zero == 3 else 0.0)
            moments.append(at_first_blk - blk_grads + (layers - 1) * (kept - blk_tok * tokens))
    if layers and c.fsdp and s.pp_reshard_grads:
        # Every micro-batch's backward reduce-scatters block by block. At a block's reduce-scatter its
        # unsharded gradients are copied into FSDP's flat reduce-scatter input while still referenced:
        # with a reduce dtype other than the compute dtype that copy is `unit`'s reduce-dtype term,
        # otherwise an extra one (fake-tensor trace, fp32: the first micro-batch 6 % over
        # `at_first_blk` without it).
        rs_copy = r * c.block_params if r == e else 0.0
        moments.append(at_first_blk + rs_copy)
        # A later one: also the sharded gradients of every block from the earlier micro-batches, the
        # block's fresh shard before it is added into them, the root unit's unsharded gradient (head)
        # until its post-backward and, on the first stage, the root's parameters gathered again
        # (resharded after the previous backward). Measured on real gloo runs (planner7m,
        # FSDP(2) x PP(2), 1F1B, fp32 and bf16): both stages within 3 %.
        regathered = e * c.vocab_params if c.first_stage and zero == 3 else 0.0
        moments.append(at_first_blk + rs_copy + all_grads + regathered - fewer)
    elif layers and fresh and gathered:
        # 1F1B: the blocks are gathered again one at a time, as this micro-batch's activations are
        # freed: the stage's gradients with the first block's activations, or every block gathered
        # with the last block's. (Counting both at once put stage 1 of 1F1B 8 % over real runs.)
        later = at_first_blk - blk_grads - head_grads + all_grads - fewer
        moments.append(later - gathered)
        moments.append(later - (layers - 1) * blk_tok * tokens)
    elif layers:
        moments.append(at_first_blk - blk_grads - head_grads + all_grads - fewer)
    if c.last_stage:
        # At a later micro-batch's loss backward: every gradient of the stage. Under 1F1B the blocks'
        # parameters are sharded again (that micro-batch's forward resharded them); measured
        # (fake-tensor trace, Llama-3.1-8B FSDP(2) x PP(4), last stage): 12 % over without this.
        # Under GPipe they stay gathered from the previous backward.
        moments.append(base + loss_bwd + all_grads + in_unit - (gathered if fresh else 0.0) - fewer)
    return moments
