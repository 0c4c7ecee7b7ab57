"""The backward phase of one stage's plan: the largest of its moments, in bytes on the stage's most
loaded rank, given what forward left (the static and forward lines of dtlaunch.plan.stage).

The moments, each a function below:
  the loss's backward (last stage): everything forward kept, plus the loss's own gradients
    (dtlaunch.plan.loss_terms);
  inside the first block's backward (most activations still held): the block's working set (its
    recompute, activation gradients, unsharded parameters and gradients), `_at_first_block`;
  inside the last block's backward (most gradients produced): `_at_last_block`;
  FSDP's reduce-scatter of the root unit at the end of backward, and of a trained head unit of its own
    right after the loss's backward;
  under a pipeline, a later micro-batch's backward, with every gradient of the stage allocated.
Where a term was fitted to measurements (real gloo runs, `plan --trace`), its comment names the run.
"""

from __future__ import annotations

from dtlaunch.plan import autocast_casts, offload
from dtlaunch.plan.cp_terms import backward_exchange_bytes
from dtlaunch.plan.hardware import GLOO_EXTRA_BUFFER_COPIES, gloo_collectives
from dtlaunch.plan.lines import Line
from dtlaunch.plan.loss_terms import held_logits, loss_backward_bytes, regathered_root
from dtlaunch.plan.peft import gathered_block
from dtlaunch.plan.shape import StageShape, block_saved_bytes, loss_saved_per_token, mean_block_saved_per_token
from dtlaunch.plan.tiled_terms import grad_sum_bytes, mlp_saved_bytes, tile_working_bytes, tiled

# Measured corrections (each names the test that measures it; tests/unit/test_plan_corrections.py checks
# that the test exists and sees the term).
# Fine-tuning under ZeRO-3: gathered blocks at the first block's backward beyond the block itself (FSDP2's
# prefetch of the next; `_prefetched_block`; traced planner7m LoRA / QLoRA ZeRO-3).
# Measured by tests/unit/test_plan_peft.py::test_head_unit_plan_within_5_percent_of_trace
LORA_ZERO3_PREFETCHED_BLOCKS = 1
# A trained head unit's reduce-scatter input, kept until the next unit's post-backward: through the first
# block's backward (traced, Llama-3.1-8B ZeRO-3: 6 % under without it).
# Measured by tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace
HEAD_REDUCE_INPUTS_KEPT = 1


def backward_peak(c: StageShape, lines: dict[str, float]) -> float:
    """The largest backward moment, given the static and forward lines."""
    base = sum(lines.values())
    loss_bwd = loss_backward_bytes(c)  # full or chunked loss (dtlaunch.plan.loss_terms)
    head_grads = _head_grads(c)
    block_grads = _block_grads(c)
    first_block = _at_first_block(c, lines, base, head_grads, block_grads)
    last_block = _at_last_block(c, first_block, block_grads)
    # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward: a trained head unit's
    # stays through the first block's backward (HEAD_REDUCE_INPUTS_KEPT).
    if c.trained_head_unit:
        first_block += HEAD_REDUCE_INPUTS_KEPT * c.reduce_bytes * c.vocab_params
    moments = [base + loss_bwd, first_block if c.layers else 0.0, last_block if c.layers else 0.0]
    moments.append(_root_reduce_moment(c, lines, c.layers * block_grads if _gradients_grow(c) else 0.0))
    moments.append(_head_reduce_moment(c, base))
    if c.pp > 1 and c.pp_microbatches > 1:
        moments += _later_microbatch_moments(c, lines, base, loss_bwd, first_block, block_grads, head_grads)
    return max(moments)


def _grad_shards(c: StageShape) -> int:
    """What a gradient held between its reduce-scatter and the step is divided by."""
    return c.shard_ranks if c.fsdp else 1


def _head_grads(c: StageShape) -> float:
    """The head's and the final norm's gradients (last stage), produced by the loss's backward and held
    through the blocks' backward: fp32 (sharded under FSDP), or unsharded in the compute dtype under
    ZeRO-3 until the root unit's reduce-scatter. A trained head unit of its own was reduce-scattered at
    its post-backward: its shard stays, the final norm's unsharded gradient waits for the root's. The
    head and the final norm of a fine-tuned model are frozen."""
    h, v, e = c.block_dims.h, c.vocab_params, c.compute_bytes
    if c.peft:
        return 0.0
    if c.trained_head_unit:
        return c.head_grad_shard_bytes + (e * h if c.zero_stage == 3 else 4 * h / _grad_shards(c))
    if c.fsdp and c.zero_stage == 3:
        return e * (v + h) if c.last_stage else 0.0
    return (4 * (v + h) if c.last_stage else 0.0) / _grad_shards(c)


def _block_grads(c: StageShape) -> float:
    """One block's gradients once its backward is done. Under CPU offload without accumulation each
    block's gradient shard becomes the host gradient as its reduce-scatter ends (with accumulation it
    stays on the device until it is added into the host's: measured on gloo runs)."""
    if not c.layers or (offload.cpu_offload(c) and c.accum_steps == 1):
        return 0.0
    return c.grad_element_bytes * c.trained_block_params / _grad_shards(c)


def _gradients_grow(c: StageShape) -> bool:
    """Whether the blocks' gradients are new allocations during backward. With accumulation they exist
    from the earlier micro-steps (the "accumulated gradients" line) and are added into in place:
    counting them again put Llama-3.1-70B FSDP x TP, 16 micro-steps, 12 % over its trace. Under CPU
    offload each block's gradient shard leaves for the host; with the step in backward each is freed
    at once."""
    in_backward = bool(c.optim and c.optim.in_backward)
    return c.accum_steps == 1 and not offload.cpu_offload(c) and not in_backward


def _unsharded_block(c: StageShape) -> float:
    """FSDP: the block being differentiated, its gathered parameters (ZeRO-3) and unsharded gradients
    (+ their reduce-dtype copy); CPU offload also copies its fp32 shard in to be gathered. Measured: the
    prefetched next block does not add at the peak (fine-tuning's does: `_prefetched_block`)."""
    if not c.fsdp:
        return 0.0
    e, r, zero = c.compute_bytes, c.reduce_bytes, c.zero_stage
    if c.peft:
        gathered = gathered_block(c.peft, c.gathered_block_params, e) if zero == 3 else 0.0
        return gathered + (e + (r if r != e else 0)) * c.trained_block_params
    unit = (e * c.gathered_block_params if zero == 3 else 0.0) + (e + (r if r != e else 0)) * c.gathered_block_params
    return unit + offload.staging_bytes(c)


def _recompute_per_token(c: StageShape, no_ac: float) -> float:
    """The block being recomputed: the most any checkpointed kind of this stage re-creates at once, per
    token (`no_ac`: a block's saved bytes per token without AC)."""
    kinds = [k for k in c.ac_mix if k != "none" and c.ac_mix[k]]
    return max((no_ac - c.block_saved_per_token[k] for k in kinds), default=0.0)


def _largest_kind_excess(c: StageShape) -> float:
    """Per token, what the stage's block kind that creates the most in its backward (recompute and working set)
    creates more than the mean block the stage is sized with: a hybrid family's kinds (`act.block_kinds`, e.g. the
    Gated DeltaNet and full-attention blocks) differ a lot there, and the peak comes inside the larger one's
    backward with (nearly) every activation held. Families of one kind: 0."""
    act = c.activation_model
    kinds_of = getattr(act, "block_kinds", None)
    if kinds_of is None:
        return 0.0
    d, e, tp, t = c.block_dims, c.compute_bytes, c.tp, c.cfg.training
    sp, autocast, compiled = c.sequence_parallel, c.fp32_residual, c.compiled
    checkpointed = [k for k in c.ac_mix if k != "none" and c.ac_mix[k]]

    def created(dims: object) -> float:
        full = act.block_bytes_no_ac(dims, e, tp, sp, autocast, compiled)
        recompute = max(
            (full - block_saved_bytes(act, k, dims, e, t, tp, sp, autocast, compiled) for k in checkpointed),
            default=0.0,
        )
        return act.backward_working_bytes(dims, e, tp) + recompute

    return max(0.0, max(created(k) for k in kinds_of(d)) - created(d))


def _block_working_set(c: StageShape) -> float:
    """What one block's backward creates and frees again: its recompute, the activation gradients (the
    tiled MLP's one tile at a time and its summed weight gradients), QLoRA's dequantised weight, context
    parallel's K/V exchange and, under autocast, a recomputed block's weight casts."""
    d, e, tp, act = c.block_dims, c.compute_bytes, c.tp, c.activation_model
    no_ac = act.block_bytes_no_ac(d, e, tp, c.sequence_parallel, c.fp32_residual, c.compiled)
    attention = _flash_backward_per_token(c)
    work = (max(act.backward_working_bytes(d, e, tp), attention) + _recompute_per_token(c, no_ac)) * c.tokens
    if tiled(act, c.mlp_tiles):  # dtlaunch.plan.tiled_terms
        no_ac -= mlp_saved_bytes(act, d, e, tp, c.compiled)
        grads = act.backward_working_bytes(d, e, tp) + tile_working_bytes(act, d, e, tp, c.mlp_tiles)
        work = (max(grads, attention) + _recompute_per_token(c, no_ac)) * c.tokens
        work += grad_sum_bytes(act, d, c.grad_element_bytes, tp, not c.peft)
    work += _largest_kind_excess(c) * c.tokens  # a hybrid family's largest block kind
    if c.peft and c.peft.qlora:
        work += c.peft.dequant  # one NF4 weight dequantised for its matmul
    if c.cp > 1:
        # Every row of the micro-batch (a preference pair is two: real 2-rank gloo DPO runs, CP(2), were
        # 3 % under with the exchange of one row per sample).
        work += backward_exchange_bytes(c)
    if c.autocast and c.blocks_without_ac < c.layers:
        # The recomputed block casts its weights again.
        work += e * (c.peft.adapters_block if c.peft else c.block_params - c.block_norm_params)
    return work


def _flash_backward_per_token(c: StageShape) -> float:
    """Per token, the attention's backward moment where it runs CUDA's flash kernel: a GPU profile, without
    context parallel or under Ulysses (the whole sequence for heads / cp heads: per token of the rank's
    share, the same bytes), a family that states it (`flash_backward_bytes`: the dense, MoE and Gated DeltaNet
    hybrid blocks; not yet MLA, whose q/k and v head widths differ and so take another kernel); 0 elsewhere:
    ring attention (its chunks' kernels and exchanges: dtlaunch.plan.cp_terms) and the CPU's kernel, which
    keeps no fp32 accumulator (the CPU suite's runs are exact without the term)."""
    fn = getattr(c.activation_model, "flash_backward_bytes", None)
    ring = c.cp > 1 and str(c.cfg.strategy.cp_style) != "ulysses"
    if fn is None or int(c.cfg.hardware.gpus_per_node) == 0 or ring:
        return 0.0
    return fn(c.block_dims, c.compute_bytes, c.tp) or 0.0


def _held_activations(c: StageShape, lines: dict[str, float]) -> float:
    """The forward's activations still held in the blocks' backward. The loss's backward frees the final
    norm's and log_softmax's saved tensors of its own micro-batch only: under a pipeline the other
    micro-batches in flight keep theirs (subtracting them for every micro-batch in flight put GPipe's
    last stage 13 % under real gloo runs). A full pass's logits stay referenced until backward returns."""
    held = lines[Line.ACTIVATIONS] - (loss_saved_per_token(c) * c.tokens if c.last_stage else 0.0)
    return held + held_logits(c)


def _prefetched_block(c: StageShape) -> float:
    """Fine-tuning under ZeRO-3: the next block's unit, prefetched by the block's pre-backward (FSDP2
    gathers the unit that ran before it in forward), is already gathered at the first block's peak: a
    traced CPU run (`plan --trace`, planner7m LoRA / QLoRA ZeRO-3) has one gathered block in "Unsharded
    Param" and one in "All Gather". (Full training's larger gradients put its peak after the prefetch is
    consumed.) The frozen embedding's unit is prefetched only by the last block processed, when the
    activations are gone, and the frozen head's after the loss: neither adds. Under expert parallel the
    traced peak (planner_moe LoRA ZeRO-3, EP 2) holds one gathered block and nothing in "All Gather":
    counting the prefetch put the real run 5 % over."""
    if not (c.peft and c.fsdp and c.zero_stage == 3 and c.layers > 1):
        return 0.0
    blocks = LORA_ZERO3_PREFETCHED_BLOCKS if c.ep == 1 else 0
    return blocks * gathered_block(c.peft, c.gathered_block_params, c.compute_bytes) if blocks else 0.0


def _at_first_block(
    c: StageShape, lines: dict[str, float], base: float, head_grads: float, block_grads: float
) -> float:
    """Inside the first block's backward (the last block of forward): every activation but the loss's
    still held, the head's gradients, the block's unsharded parameters and gradients, its working set,
    and what offloading, a chunked loss under ZeRO-3 x TP and fine-tuning's prefetch bring back."""
    held = _held_activations(c, lines)
    unit = _unsharded_block(c)
    at_first = base - lines[Line.ACTIVATIONS] + held + head_grads + unit + _block_working_set(c) + block_grads
    at_first += offload.reloaded_block(c)  # activation offload: the block's saved set back from the host
    at_first += regathered_root(c)  # a chunked loss's gather of the root unit (dtlaunch.plan.loss_terms)
    at_first += _prefetched_block(c)
    at_first -= autocast_casts.head_cast(c)  # freed by the loss's backward, the last to read it
    if c.optim and c.optim.in_backward:
        # The update of one tensor runs inside backward, its gradient freed right after: a block's inside
        # the block's backward.
        at_first += c.optim.temp_block
    return at_first


def _device_block_per_token(c: StageShape) -> float:
    """The stage's mean block's saved bytes per token still on the device (training.activation_offload
    moves the rest)."""
    moved = offload.moved_per_token(c) / c.layers if c.layers else 0.0
    return mean_block_saved_per_token(c) - moved


def _at_last_block(c: StageShape, at_first: float, block_grads: float) -> float:
    """Inside the last block's backward, and right after it in the first stage's embedding's: the other
    blocks' activations and autocast weight casts freed, their gradients produced (where they grow), the
    root unit's update under a step in backward; in the embedding's backward its gradient (unsharded before
    its reduce-scatter under ZeRO-3), once the last block's working set is freed (without FSDP; under FSDP at
    the block's peak). Counting the embedding's gradient inside the block's backward put one H200 process
    (Llama-3.1-8B width, 4 layers, autocast) 6-7.5 % over its measured peak with any activation checkpointing
    or a chunked loss; with these terms the 2,048-token rows are within 1.5 % (bench/gpu, gpu_bench.py)."""
    layers, v = c.layers, c.vocab_params
    grown = max(0, layers - 1) * block_grads if _gradients_grow(c) else 0.0
    freed = (layers - 1) * (
        _device_block_per_token(c) * c.tokens * c.microbatches_in_flight + autocast_casts.block_cast(c)
    )
    at_last = at_first - freed + grown
    if c.optim and c.optim.in_backward:
        at_last += c.optim.temp - c.optim.temp_block  # the root unit's (embedding, head) after the last block
    embedding_grad = 0.0
    if c.first_stage and c.fsdp and c.zero_stage == 3 and not c.peft:  # (a frozen embedding has no gradient)
        embedding_grad = c.compute_bytes * v  # unsharded before its reduce-scatter
    elif c.first_stage and c.accum_steps == 1 and not c.peft:
        embedding_grad = 4 * v / _grad_shards(c)
    if c.fsdp:
        # FSDP2 still holds the last block's reduce-scatter buffers and the gathered root unit then: traced
        # runs (test_plan_trace.py, ZeRO-3 x TP with full AC) peak with the embedding's gradient beside them.
        return at_last + embedding_grad
    return max(at_last, at_last - _block_working_set(c) + embedding_grad)


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
    static = sum(lines.values()) - lines[Line.ACTIVATIONS] + c.head_grad_shard_bytes
    if c.zero_stage == 2:
        # ZeRO-2's blocks were resharded after their own backward: what stays gathered is what ZeRO-3
        # holds, the root's head and final norm (measured: the embedding's gathered copy does not add).
        held = c.compute_bytes * (root - (c.vocab_params if c.first_stage else 0))
        static -= max(0.0, lines.get(Line.UNSHARDED_PARAMETERS, 0.0) - held)
    return static + block_grads + _reduce_per_param(c) * root


def _reduce_per_param(c: StageShape) -> float:
    """Bytes per parameter at an FSDP unit's reduce-scatter: its unsharded gradients copied into a flat
    reduce-dtype input (e + r), then that input next to its output shard (r + r / shard); gloo's
    reduce-scatter (a CPU profile) copies its input once more, NCCL does not."""
    gloo = gloo_collectives(c.cfg.hardware)
    return max(
        c.compute_bytes + c.reduce_bytes,
        c.reduce_bytes + c.reduce_bytes / c.shard_ranks + (GLOO_EXTRA_BUFFER_COPIES * c.reduce_bytes if gloo else 0),
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
        + (
            buffer
            + c.compute_bytes
            + c.reduce_bytes
            + c.reduce_bytes / c.shard_ranks
            + (GLOO_EXTRA_BUFFER_COPIES * c.reduce_bytes if gloo else 0)
        )
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
) -> list[float]:
    """A later pipeline micro-batch's backward: the stage's gradients are all allocated by the earlier ones
    while the schedule still holds its in-flight activations (1F1B: the same count as in warm-up; GPipe:
    one fewer). Measured on real 1F1B runs: this, not the first backward, is stage 0's peak."""
    s, e, r, layers, tokens, zero = c.cfg.strategy, c.compute_bytes, c.reduce_bytes, c.layers, c.tokens, c.zero_stage
    blk_tok = _device_block_per_token(c)
    per_mb = lines[Line.ACTIVATIONS] / c.microbatches_in_flight
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
        gathered = e * c.gathered_params - lines.get(Line.UNSHARDED_PARAMETERS, 0.0) if zero == 3 else 0.0
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
