"""The analytic per-rank memory model (pure Python, never imports torch).

For every pipeline stage (the most loaded rank of each stage) it adds up, in bytes of tensors the
runtime allocates:
  parameters (fp32 — FSDP2 keeps fp32 shards, DDP fp32 replicas), gradients, AdamW state,
  unsharded FSDP parameters in compute dtype (ZeRO-2 holds all of the stage's from forward to the
  end of backward; ZeRO-3 about two blocks in flight), unsharded gradients before reduce-scatter,
  saved activations (activations.py) times micro-batches in flight under the pipeline schedule,
  logits/loss buffers (last stage only) and, on CPU, the foreach-AdamW temporary at the optimizer
  step (GPU runs step with the fused kernel, which has none),
and evaluates three phases: end of forward, start of backward (saved activations + loss gradients)
and optimizer step (gradients + state + temporary, from step 2 on when Adam state exists).
The peak is the largest phase. Device overheads (CUDA context, communicator buffers, allocator
fragmentation) come from the hardware profile and are reported as separate lines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dtlaunch.config.layout import Layout, grad_accum_steps, pp_microbatches, pp_stage_layers
from dtlaunch.models.dtypes import DTYPE_BYTES
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.experts import all_to_all_bytes, grouped_gemm, rank_imbalance, stage_routed_params
from dtlaunch.plan.hardware import fused_optimizer
from dtlaunch.plan.peft import gathered_block, param_lines, peft_notes, peft_terms

GIB = 1024**3
PHASES = ("forward", "backward", "optimizer")


@dataclass
class StagePlan:
    stage: int
    layers: int
    params: int  # parameters held by one rank of this stage (after TP division)
    lines: dict[str, float]  # category -> bytes at this stage's peak phase
    phases: dict[str, float]  # phase -> total bytes
    phase: str
    peak: float


@dataclass
class MemoryPlan:
    recipe: str
    hardware: str
    capacity: float  # bytes on the device
    layout: dict[str, int]
    stages: list[StagePlan]
    worst: StagePlan
    overheads: dict[str, float]
    notes: list[str] = field(default_factory=list)
    suggestions: list[dict] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """Allocated bytes at the peak on the most loaded rank (the figure a run measures)."""
        return self.worst.peak

    @property
    def device_total(self) -> float:
        return self.peak + sum(self.overheads.values())

    @property
    def headroom(self) -> float:
        return self.capacity - self.device_total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "hardware": self.hardware,
            "capacity_bytes": int(self.capacity),
            "layout": self.layout,
            "peak_bytes": int(self.peak),
            "peak_phase": self.worst.phase,
            "peak_stage": self.worst.stage,
            "device_total_bytes": int(self.device_total),
            "headroom_bytes": int(self.headroom),
            "fits": self.fits,
            "verdict": "fits" if self.fits else "does not fit",
            "categories": {k: int(v) for k, v in self.worst.lines.items()},
            "overheads": {k: int(v) for k, v in self.overheads.items()},
            "stages": [
                {
                    "stage": s.stage,
                    "layers": s.layers,
                    "params": s.params,
                    "peak_bytes": int(s.peak),
                    "phase": s.phase,
                    "phases": {k: int(v) for k, v in s.phases.items()},
                    "categories": {k: int(v) for k, v in s.lines.items()},
                }
                for s in self.stages
            ],
            "notes": list(self.notes),
            "suggestions": list(self.suggestions),
        }


def _block_tok(act: Any, kind: str, d: Any, e: int, t: Any, tp: int, sp: bool, autocast: bool, compiled: bool) -> float:
    """Saved bytes per token of one block under a checkpointing kind of `act.ac_mix`."""
    if kind == "budget":
        return act.block_bytes_budget(d, e, float(t.ac_memory_budget), tp, sp, autocast)
    return act.block_bytes(d, e, kind, tp, sp, autocast, compiled)


def in_flight(schedule: str, pp: int, rank: int, n_mb: int, per_rank: int = 1) -> float:
    """Pipeline micro-batches whose activations one rank holds at once, in units of the rank's
    whole layer set. 1F1B: stage i holds min(p - i, m); GPipe (and looped BFS): all m;
    interleaved: (v-1)·p + 2·(p-1-i) + 1 chunk-forwards warm up, each 1/v of the rank's layers."""
    if pp == 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs", "ScheduleGPipe", "ScheduleLoopedBFS"):
        return float(n_mb)
    if per_rank > 1:
        warm = (per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1
        return min(warm, n_mb * per_rank) / per_rank
    return float(min(pp - rank, n_mb))


def _stage_params(m: Any, layers: int, first: bool, last: bool, tp: int) -> tuple[int, int, int]:
    """(params on one TP rank of the stage, one block's params, the root unit's params: embedding,
    final norm, output head on the stages that own them). Matrices divide by tp, norm weights not."""
    spec = model_spec(m)
    blk_norms = spec.block_norm_params(m)
    blk = (spec.block_params(m) - blk_norms) // tp + blk_norms
    root = 0
    if first:
        root += spec.embedding_params(m) // tp
    if last:
        # A tied head is the embedding's matrix: counted once (tied models refuse pp > 1).
        root += spec.head_params(m) // tp + m.dim
        if spec.head_params(m) == 0 and not first:
            root += spec.embedding_params(m) // tp
    return layers * blk + root, blk, root


def plan_stage(
    cfg: Any, layout: Layout, stage: int, layers: int, first: bool, last: bool, layer_ids: list[int] | None = None
) -> StagePlan:
    m, s, t = cfg.model, cfg.strategy, cfg.training
    spec = model_spec(m)
    act = spec.act()
    d = act.BlockDims.of(m)
    if hasattr(d, "grouped"):
        d = dataclasses.replace(d, grouped=grouped_gemm(cfg))
    if layout.ep > 1 and hasattr(d, "routed_scale"):
        # Expert parallel: a rank computes the copies routed to its experts, the busiest rank more than the
        # balanced share.
        d = dataclasses.replace(d, routed_scale=rank_imbalance(cfg, layout.ep), ep=layout.ep)
    norm_gains = spec.block_norm_params(m)
    tied_head = spec.head_params(m) == 0
    tp, pp = layout.tp, layout.pp
    sp = bool(s.sequence_parallel) and tp > 1
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    r = DTYPE_BYTES[cfg.precision.reduce_dtype]
    zero = int(s.zero_stage)
    # Context-parallel ranks hold the same parameters: FSDP / ZeRO shard (and DDP averages) over dp x cp.
    cp = layout.cp
    fsdp = zero >= 2 and layout.dp * cp > 1
    shard = layout.shard if (zero >= 2 and layout.dp * cp > 1) or zero == 1 else 1
    ddp = zero in (0, 1) and layout.dp * cp > 1
    # The runtime casts with autocast wherever FSDP's MixedPrecisionPolicy does not (parallelize.compute_context).
    autocast = e != 4 and not fsdp
    p_rank, blk, root = _stage_params(m, layers, first, last, tp)
    # Routed experts (MoE): whole on every TP rank; a gathered block holds only this rank's 1/ep of them.
    routed = stage_routed_params(m, layer_ids if layer_ids is not None else list(range(layers)))
    if routed and tp > 1:
        p_rank += routed - routed // tp
        blk += (routed - routed // tp) // max(layers, 1)
    not_gathered = routed - routed // layout.ep
    p_gather = p_rank - not_gathered
    blk_gather = blk - not_gathered // max(layers, 1)
    accum = grad_accum_steps(cfg, layout)
    n_mb = pp_microbatches(cfg, layout) if pp > 1 else 1
    tokens = (t.micro_batch // n_mb) * t.seq_len // cp  # this rank's tokens: CP splits each sequence
    mix = act.ac_mix(t, layer_ids if layer_ids is not None else list(range(layers)))
    kept = mix.get("none", 0)  # blocks that keep their whole no-AC set
    compiled = bool(t.compile)
    # Fine-tuning (peft.method=lora/qlora): only the adapters train; QLoRA's base is NF4 (plan/peft.py).
    ft = peft_terms(cfg, layers, tp, sp, shard if fsdp else 1, e, autocast)
    trained, trained_blk = (ft.adapters, ft.adapters_block) if ft else (p_rank, blk)

    lines: dict[str, float] = {}
    lines["parameters"] = 4 * p_rank / (shard if fsdp else 1)
    if ft:
        frozen_linear = layers * (blk - norm_gains) + (spec.head_params(m) // tp if last else 0)
        lines.update(param_lines(ft, p_rank, frozen_linear, layers, shard if fsdp else 1, e))
    rope_table = int(t.seq_len) * (d.head // 2)  # the runtime builds RoPE for training.seq_len positions
    lines["buffers"] = 2 * 4 * rope_table  # RoPE cos/sin, fp32
    if cp > 1:
        # The tables picked at this rank's token positions (Decoder.forward), shared by every block.
        lines["RoPE tables (CP positions)"] = 2 * (e if fsdp else 4) * (t.seq_len // cp) * (d.head // 2)
    if fsdp and e != 4:
        # The hidden state is in the compute dtype, so the model casts both tables to it once per forward
        # (llama.Llama.forward); every block shares that copy until backward is done.
        lines["RoPE tables (compute dtype)"] = 2 * e * rope_table
    lines["optimizer state"] = 8 * trained / shard
    grads = 4 * trained / (shard if fsdp else 1)
    if ddp:
        # DDP (gradient_as_bucket_view off) keeps flat fp32 buckets for the whole run; gradients are
        # separate tensors, allocated in backward and set to None after the step.
        lines["DDP buckets"] = 4 * trained
    if accum > 1:
        # Between accumulation micro-steps the gradients stay allocated: DDP's full .grad; FSDP
        # reduce-scatters every micro-step (dtlaunch.train.parallelize.grad_sync) and keeps only shards.
        lines["accumulated gradients"] = grads
    if autocast and kept and compiled:
        # Compiled blocks recompute their weights' casts in backward instead of saving them.
        lines["autocast weight copies"] = e * v_h(m, tp) if last else 0.0
    elif autocast and kept == layers:
        # Each weight's compute-dtype copy (not the embedding's, nor norm gains) is saved by its matmul
        # from forward to backward; under AC the casts are recomputed with the block instead.
        # A tied matrix is also the head, a matmul weight: its cast is saved as well.
        head_cast = v_h(m, tp) if tied_head and last else 0
        lines["autocast weight copies"] = e * (p_rank - (v_h(m, tp) if first else 0) - norm_gains * layers + head_cast)
    elif autocast and kept:  # layer policy: the blocks it does not checkpoint keep their copies
        lines["autocast weight copies"] = e * (kept * (blk - norm_gains) + (v_h(m, tp) if last else 0))
    elif autocast and last:
        lines["autocast weight copies"] = e * v_h(m, tp)
    if ft and autocast:
        # Frozen linears are stored in the compute dtype (their cast is the weight itself), QLoRA's NF4
        # matmuls save the NF4 weight: only the adapters' casts (and a tied head's) are copies.
        adapters = ft.adapters if kept == layers and not compiled else 0.0
        lines["autocast weight copies"] = e * (adapters + (v_h(m, tp) if tied_head and last else 0))
    if fsdp and zero == 2:
        lines["unsharded parameters"] = e * p_gather if (shard > 1 or e != 4) else 0.0
        if ft:
            lines["unsharded parameters"] += layers * (gathered_block(ft, blk, e) - e * blk)
    elif fsdp:
        # The root unit is not resharded after forward; measured (real gloo runs, MemTracker): its
        # head and final norm stay gathered until backward, the embedding's gathered copy does not add.
        lines["unsharded parameters"] = e * (root - (v_h(m, tp) if first else 0))
    if cfg.precision.float8 != "none":
        # torchao's Float8Linear saves its input and the parameter itself (no compute-dtype weight copy:
        # it casts to float8 inside), so only the head, still a plain linear, keeps an autocast copy; on
        # top, one linear at a time holds float8 (1-byte) copies of its input and weight and their
        # transposes, bounded by the widest (F-wide) linear and split by TP like the linear itself.
        if "autocast weight copies" in lines:
            lines["autocast weight copies"] = min(lines["autocast weight copies"], e * v_h(m, tp) if last else 0.0)
        lines["float8 casts"] = 2 * (tokens + d.h) * d.f / tp
    per_rank_stages = int(s.pp_stages_per_rank) if pp > 1 else 1
    held = in_flight(s.pp_schedule, pp, stage % pp, n_mb, per_rank_stages)
    by_kind = {k: _block_tok(act, k, d, e, t, tp, sp, autocast, compiled) for k in mix}
    if cp > 1 and fused_optimizer(cfg.hardware) and "none" in by_kind:
        # GPU context parallel: K/V heads are repeated to the query heads before torch's ring SDPA,
        # which then keeps the repeated copies for backward instead of the grouped ones.
        by_kind["none"] += e * 2 * (d.qw - d.k) / tp
    if fsdp and sp and "selective" in by_kind:
        # Empirical (real FSDP x TP runs, MemTracker): selective AC under sequence parallel keeps one
        # gathered (full-sequence) hidden state per block that the op-level count does not explain.
        by_kind["selective"] += e * d.h
    if ft and "selective" in by_kind and t.ac_policy == "op":
        by_kind["selective"] += ft.selective
    per_token = sum(n * by_kind[k] for k, n in mix.items())
    if ft:
        # The frozen base keeps less (frozen norm gains; the first block's input needs no gradient);
        # the adapters' own saved tensors are the "LoRA activations" line.
        per_token += kept * ft.act_block + (ft.act_first if first and kept else 0.0)
        lines["LoRA activations"] = kept * ft.adapter_act * tokens * held
    blk_tok = per_token / layers if layers else 0.0  # the mean block
    if first:
        per_token += act.embedding_bytes(d, e)
    loss_saved = 0.0
    if last:
        final_norm = ft.final_norm if ft else act.final_norm_bytes(d, e, tp, sp, autocast)
        loss_saved = final_norm + act.logits_forward_bytes(d, e, tp)
        per_token += loss_saved
    # Under autocast the hidden state stays fp32 and each block's RoPE casts its own table slices.
    rope = act.rope_cast_bytes(d, e, int(t.seq_len) // cp) * kept if autocast and not compiled else 0.0
    lines["activations"] = (per_token * tokens + rope * (t.micro_batch // n_mb) / t.micro_batch) * held
    a2a = all_to_all_bytes(cfg, layout.ep, tokens, e)
    if a2a:
        lines["all-to-all buffers"] = a2a
    base = sum(lines.values())

    # Backward, two moments: (1) log_softmax's backward on the last stage (everything forward kept +
    # the fp32 loss gradients), (2) inside a block's backward: its recompute set, activation
    # gradients, its unsharded parameters (+ the prefetched next block) and gradients, and the
    # gradients already produced. (2) is taken at the first block processed (most activations still
    # held) and at the last (most gradients produced).
    loss_bwd = act.logits_backward_bytes(d, e, tp) * tokens if last else 0.0
    head_grads = (4 * (v_h(m, tp) + d.h) if last else 0.0) / (shard if fsdp else 1)
    unit = 0.0
    if fsdp:
        # The block being differentiated: its gathered parameters (ZeRO-3) and unsharded gradients
        # (+ their reduce-dtype copy). Measured: the prefetched next block does not add at the peak.
        unit = (e * blk_gather if zero == 3 else 0.0) + (e + (r if r != e else 0)) * blk_gather
        head_grads = (e * (v_h(m, tp) + d.h) if last else 0.0) if zero == 3 else head_grads
        if ft:
            unit = (gathered_block(ft, blk_gather, e) if zero == 3 else 0.0) + (e + (r if r != e else 0)) * trained_blk
    if ft:
        head_grads = 0.0  # the head and final norm are frozen
    # The block being recomputed: the most any checkpointed kind of this stage re-creates at once.
    none_tok = act.block_bytes_no_ac(d, e, tp, sp, autocast, compiled)
    recompute = max((none_tok - by_kind[k] for k in mix if k != "none" and mix[k]), default=0.0)
    work = (act.backward_working_bytes(d, e, tp) + recompute) * tokens
    if ft and ft.qlora:
        work += ft.dequant  # one NF4 weight dequantised for its matmul
    if cp > 1:
        work += cp_exchange_bytes(d, e, tp, (t.micro_batch // n_mb) * t.seq_len)
    if autocast and kept < layers:
        work += e * (ft.adapters_block if ft else blk - norm_gains)  # the recomputed block casts its weights again
    # The loss backward frees the final norm's and log_softmax's saved tensors of its own micro-batch
    # only: under a pipeline the other micro-batches in flight keep theirs. (Subtracting them for every
    # micro-batch in flight put GPipe's last stage 13 % under real gloo runs.)
    held_act = lines["activations"] - (loss_saved * tokens if last else 0.0)
    if last:
        held_act += e * d.vocab / tp * tokens  # the logits stay referenced until backward returns
    blk_grads = (4 * trained_blk / (shard if fsdp else 1)) if layers else 0.0
    at_first_blk = base - lines["activations"] + held_act + head_grads + unit + work + blk_grads
    if ft and fsdp and zero == 3 and first and kept == 0:
        # Fine-tuning under full AC: the root unit's frozen embedding is still gathered when the blocks'
        # backward starts (traced real FSDP2 step, planner7m LoRA fp32: embedding + head + one block).
        at_first_blk += e * v_h(m, tp)
    # Gradients produced since the first block: with accumulation they already exist from the earlier
    # micro-steps (the "accumulated gradients" line) and are added into in place, so nothing grows.
    # (Counting them again put Llama-3.1-70B FSDP x TP, 16 micro-steps, 12 % over its trace.)
    grown = max(0, layers - 1) * blk_grads if accum == 1 else 0.0
    at_last_blk = at_first_blk - (layers - 1) * blk_tok * tokens * held + grown
    if first and fsdp and zero == 3 and not ft:  # (a frozen embedding has no gradient)
        at_last_blk += e * v_h(m, tp)  # the embedding's unsharded gradient before its reduce-scatter
    elif first and accum == 1 and not ft:
        at_last_blk += 4 * v_h(m, tp) / (shard if fsdp else 1)
    backward = [base + loss_bwd, at_first_blk if layers else 0.0, at_last_blk if layers else 0.0]
    if pp > 1 and n_mb > 1:
        # A later micro-batch's backward: the stage's gradients are all allocated by the earlier ones
        # while the schedule still holds its in-flight activations (1F1B: the same count as in warm-up;
        # GPipe: one fewer). Measured on real 1F1B runs: this, not the first backward, is stage 0's peak.
        per_mb = lines["activations"] / held
        fewer = per_mb if held >= n_mb else 0.0
        # 1F1B's steady state runs a forward between two backwards, which reshards the blocks (ZeRO-3);
        # GPipe's backwards follow one another, so what a backward left gathered stays gathered.
        fresh = held < n_mb
        all_grads = grads if accum == 1 else 0.0  # with accumulation they are in `base` already
        gathered = in_unit = 0.0
        # strategy.pp_reshard_grads=true: every micro-batch's backward reduce-scatters block by block as a
        # non-pipelined FSDP micro-step does, so the later micro-batches only add to sharded gradients.
        if fsdp and not s.pp_reshard_grads:
            # torch's pipeline stage turns FSDP's gradient sync and resharding off for every micro-batch
            # but the last: the whole stage's gradients accumulate unsharded (reduce dtype) and its
            # parameters stay gathered (ZeRO-3). They include the block in flight (`unit`), bar the
            # compute-dtype gradient it has just produced. Measured: Llama-3.1-8B FSDP(2) x PP(4)
            # stage 0 was 23 % under its trace without this.
            gathered = e * p_gather - lines.get("unsharded parameters", 0.0) if zero == 3 else 0.0
            # `unit` holds the block's gathered parameters (in `gathered`), the compute-dtype gradient it
            # has just produced (a transient before it is added in) and, with a reduce dtype other than
            # the compute dtype, the accumulated copy (in r * p_gather). Measured (fake-tensor trace,
            # planner7m FSDP(2) x PP(2), 1F1B, fp32): the transient is in the peak.
            in_unit = (e * blk_gather if zero == 3 else 0.0) + (r * blk_gather if r != e else 0.0)
            all_grads = r * p_gather + gathered - (in_unit if layers else 0.0)
            if layers:
                # The first micro-batch's backward at its last block: every block before it left its
                # unsharded gradients and (ZeRO-3) its gathered parameters. Measured (real gloo runs,
                # planner7m FSDP(2) x PP(2), GPipe): the last stage's peak (13 % under without it).
                kept = r * blk_gather + (e * blk_gather if zero == 3 else 0.0)
                backward.append(at_first_blk - blk_grads + (layers - 1) * (kept - blk_tok * tokens))
        if layers and fsdp and s.pp_reshard_grads:
            # Every micro-batch's backward reduce-scatters block by block. At a block's reduce-scatter its
            # unsharded gradients are copied into FSDP's flat reduce-scatter input while still referenced:
            # with a reduce dtype other than the compute dtype that copy is `unit`'s reduce-dtype term,
            # otherwise an extra one (fake-tensor trace, fp32: the first micro-batch 6 % over
            # `at_first_blk` without it).
            rs_copy = r * blk if r == e else 0.0
            backward.append(at_first_blk + rs_copy)
            # A later one: also the sharded gradients of every block from the earlier micro-batches, the
            # block's fresh shard before it is added into them, the root unit's unsharded gradient (head)
            # until its post-backward and, on the first stage, the root's parameters gathered again
            # (resharded after the previous backward). Measured on real gloo runs (planner7m,
            # FSDP(2) x PP(2), 1F1B, fp32 and bf16): both stages within 3 %.
            regathered = e * v_h(m, tp) if first and zero == 3 else 0.0
            backward.append(at_first_blk + rs_copy + all_grads + regathered - fewer)
        elif layers and fresh and gathered:
            # 1F1B: the blocks are gathered again one at a time, as this micro-batch's activations are
            # freed: the stage's gradients with the first block's activations, or every block gathered
            # with the last block's. (Counting both at once put stage 1 of 1F1B 8 % over real runs.)
            later = at_first_blk - blk_grads - head_grads + all_grads - fewer
            backward.append(later - gathered)
            backward.append(later - (layers - 1) * blk_tok * tokens)
        elif layers:
            backward.append(at_first_blk - blk_grads - head_grads + all_grads - fewer)
        if last:
            # At a later micro-batch's loss backward: every gradient of the stage. Under 1F1B the blocks'
            # parameters are sharded again (that micro-batch's forward resharded them); measured
            # (fake-tensor trace, Llama-3.1-8B FSDP(2) x PP(4), last stage): 12 % over without this.
            # Under GPipe they stay gathered from the previous backward.
            backward.append(base + loss_bwd + all_grads + in_unit - (gathered if fresh else 0.0) - fewer)
    opt_temp = 0.0 if fused_optimizer(cfg.hardware) else 4 * trained / shard
    phases = {
        "forward": base,
        "backward": max(backward),
        # Optimizer step: activations and unsharded buffers are gone; gradients are complete, and
        # foreach AdamW (CPU) allocates one temporary the size of the local fp32 state.
        "optimizer": lines["parameters"]
        + lines.get("adapter parameters", 0.0)
        + lines.get("NF4 base weights", 0.0)
        + lines["buffers"]
        + lines["optimizer state"]
        + lines.get("DDP buckets", 0.0)
        + grads
        + opt_temp,
    }
    phase = max(phases, key=lambda k: phases[k])
    if phase == "backward":
        extra = phases["backward"] - base
        lines["loss/backward buffers"] = extra
    if phase == "optimizer":
        for k in (
            "activations",
            "unsharded parameters",
            "autocast weight copies",
            "accumulated gradients",
            "RoPE tables (compute dtype)",
            "all-to-all buffers",
            "LoRA activations",
        ):
            lines.pop(k, None)
        lines["gradients"] = grads
        if opt_temp:
            lines["optimizer temporaries"] = opt_temp
    return StagePlan(
        stage=stage, layers=layers, params=p_rank, lines=lines, phases=phases, phase=phase, peak=phases[phase]
    )


def cp_exchange_bytes(d: Any, e: int, tp: int, sequence_tokens: int) -> float:
    """Context parallel, inside one attention's backward: the whole sequence's K and V gathered from the
    CP ranks (repeated to the query heads) and their fp32 gradients before the reduce-scatter back
    (dtlaunch.train.context_parallel). Transient, one block at a time; the forward's gathered copies are
    gone by then (each block gathers again in backward)."""
    return 2 * (e + 4) * d.qw / tp * sequence_tokens


def v_h(m: Any, tp: int) -> int:
    """Parameters of the embedding (or of the output head) on one TP rank."""
    return m.vocab_size * m.dim // tp


def _likely_worst(split: list[int], pp: int) -> set[int]:
    """Ranks that can hold the peak: the first (embedding, most in flight), the second (in flight),
    the last (logits) and the one with the most layers."""
    most = max(range(pp), key=lambda r: (split[r] * (pp - r), -r))
    return {0, min(1, pp - 1), pp - 1, most}


def plan_memory(cfg: Any, layout: Layout, all_stages: bool = True) -> MemoryPlan:
    """Plan every pipeline rank (or, for the search, only those that can hold the peak)."""
    s = cfg.strategy
    if not model_spec(cfg.model).analytic:
        stages = [_traced_stage(cfg, layout)]
    else:
        per_rank = int(s.pp_stages_per_rank) if layout.pp > 1 else 1
        n_stages = layout.pp * per_rank
        split = pp_stage_layers(cfg.model.n_layers, n_stages, list(s.pp_layers_per_stage) or None)
        stages = []
        ranks = range(layout.pp) if all_stages or per_rank > 1 else sorted(_likely_worst(split, layout.pp))
        for rank in ranks:
            # A rank owns stages rank, rank + pp, ... (interleaved); add its chunks up as one rank.
            owned = list(range(rank, n_stages, layout.pp))
            layers = sum(split[i] for i in owned)
            ids = [sum(split[:i]) + j for i in owned for j in range(split[i])]  # global block indices
            stages.append(
                plan_stage(cfg, layout, rank, layers, first=0 in owned, last=n_stages - 1 in owned, layer_ids=ids)
            )
    worst = max(stages, key=lambda sp: sp.peak)
    hw = cfg.hardware
    overheads = {
        "CUDA context": hw.context_gib * GIB,
        "communicator buffers": hw.comm_buffers_gib * GIB,
        "allocator fragmentation": hw.fragmentation * worst.peak,
    }
    overheads = {k: v for k, v in overheads.items() if v > 0}
    lay = {
        "world": layout.world,
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
        "pp": layout.pp,
    }
    if layout.ep > 1:
        lay["ep"] = layout.ep
    if layout.cp > 1:
        lay["cp"] = layout.cp
    notes = [] if model_spec(cfg.model).analytic else [TRACED_NOTE]
    notes += peft_notes(cfg)
    if layout.pp > 1 and int(s.zero_stage) >= 2 and layout.dp > 1:
        n_mb = pp_microbatches(cfg, layout)
        notes.append(
            f"FSDP under PP: one reduce-scatter per pipeline micro-batch ({n_mb} per micro-step), sharded "
            f"gradients only (strategy.pp_reshard_grads=true)"
            if s.pp_reshard_grads
            else f"FSDP under PP: the stage's gradients stay unsharded across the {n_mb} pipeline micro-batches, "
            f"one reduce-scatter per micro-step (strategy.pp_reshard_grads=true keeps them sharded for {n_mb}x the "
            f"reduce-scatters)"
        )
    return MemoryPlan(
        notes=notes,
        recipe=str(cfg.recipe or "custom"),
        hardware=hw.name,
        capacity=hw.memory_gib * GIB,
        layout=lay,
        stages=stages,
        worst=worst,
        overheads=overheads,
    )


TRACED_NOTE = "no closed-form memory model for this model (model._target_ or model.arch=hf_auto): planned by tracing one training step"


def _traced_stage(cfg: Any, layout: Layout) -> StagePlan:
    """The plan of a model without a closed-form memory model: one traced step of the real runtime
    on rank 0."""
    from dtlaunch.plan.trace import trace_peak

    # Fake tensors (no storage) where the runtime's path supports them (FSDP); DDP and single-process
    # layouts swap parameters in place when materialising, which fake tensors refuse: real tensors there.
    traced = trace_peak(cfg, layout, rank=0, fake=int(cfg.strategy.zero_stage) >= 2 and layout.dp > 1)
    peak = float(traced["peak_bytes"])
    params = int(model_spec(cfg.model).param_count(cfg.model))
    lines = {k: float(v) for k, v in traced["categories"].items()}
    return StagePlan(
        stage=0,
        layers=int(cfg.model.n_layers),
        params=params,
        lines=lines,
        phases={"traced": peak},
        phase="traced",
        peak=peak,
    )
