"""One pipeline stage's analytic memory plan (the most loaded rank of the stage), in four phases.

Each phase is a function of the stage's shape (`StageShape`: degrees, dtype sizes, parameter and token
counts) returning labelled byte counts:
  `static_lines`    what the rank holds for the whole step: fp32 parameters (FSDP2 keeps fp32 shards, DDP
                    fp32 replicas), AdamW state, DDP buckets, accumulated gradients, autocast weight copies,
                    unsharded FSDP parameters (ZeRO-2 holds all of the stage's from forward to the end of
                    backward; ZeRO-3 the root unit), float8 casts, RoPE tables;
  `forward_lines`   saved activations (activations.py) times micro-batches in flight under the pipeline
                    schedule, logits/loss buffers (last stage only), all-to-all buffers;
  `backward_peak`   the largest of the backward moments (the loss backward; inside the first and the last
                    block's backward; a later pipeline micro-batch's backward);
  `optimizer_lines` at the optimizer step: gradients complete, activations and unsharded buffers gone,
                    and on CPU the foreach-AdamW temporary (GPU runs step with the fused kernel).
`plan_stage` adds them up; the peak is the largest phase. Planned vs measured: tests/unit/test_plan_stage.py
(each phase against the memory tracker's categories) and bench/planner_accuracy.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from dtlaunch.config.layout import (
    Layout,
    fp32_residual,
    grad_accum_steps,
    head_unit,
    mlp_tiles,
    pp_microbatches,
    pp_stage_layers,
    rows_per_sample,
    shards_with_fsdp,
)
from dtlaunch.models.dtypes import DTYPE_BYTES
from dtlaunch.models.registry import model_spec
from dtlaunch.plan import offload
from dtlaunch.plan.cp_terms import backward_exchange_bytes
from dtlaunch.plan.experts import all_to_all_bytes, grouped_gemm, rank_imbalance, stage_routed_params
from dtlaunch.plan.generation import PHASE_GENERATION, generation_lines, generation_phases
from dtlaunch.plan.hardware import fused_optimizer, gloo_collectives
from dtlaunch.plan.loss_terms import (
    held_logits,
    logits_saved_per_token,
    loss_backward_bytes,
    loss_chunks,
    regathered_root,
)
from dtlaunch.plan.objective import reference_phases, reference_static_lines
from dtlaunch.plan.optim_terms import OptimTerms, optim_terms
from dtlaunch.plan.peft import PeftTerms, gathered_block, param_lines, peft_terms
from dtlaunch.plan.tiled_terms import grad_sum_bytes, mlp_saved_bytes, tile_working_bytes, tiled

# Lines that do not exist at the optimizer step (freed after backward).
_GONE_AT_OPTIMIZER = (
    "activations",
    "unsharded parameters",
    "autocast weight copies",
    "accumulated gradients",
    "RoPE tables (compute dtype)",
    "all-to-all buffers",
    "RoPE tables (CP positions)",
    "float8 casts",
    "LoRA activations",
)


@dataclass
class StagePlan:
    stage: int
    layers: int
    params: int  # parameters held by one rank of this stage (after TP division)
    lines: dict[str, float]  # category -> bytes at this stage's peak phase
    phases: dict[str, float]  # phase -> total bytes
    phase: str
    peak: float
    host: dict[str, float] = field(default_factory=dict)  # offloaded bytes in host RAM at the host peak

    @property
    def host_peak(self) -> float:
        return sum(self.host.values())


@dataclass(frozen=True)
class StageShape:
    """What every phase of one stage's plan reads."""

    cfg: Any
    m: Any  # the model section
    t: Any  # the training section
    act: Any  # the model family's activation model (dtlaunch.models.*.activations)
    d: Any  # its block dimensions
    stage: int
    layers: int
    first: bool
    last: bool
    tp: int
    pp: int
    cp: int
    ep: int
    sp: bool  # sequence parallel
    e: int  # bytes per element of the compute dtype
    r: int  # ... of the gradient-reduce dtype
    zero: int
    fsdp: bool
    ddp: bool
    shard: int  # ranks the optimizer state (and FSDP's parameters) are sharded over
    autocast: bool
    fp32_residual: bool  # the residual stream in fp32 under autocast (config.layout.fp32_residual)
    p_rank: int  # parameters on one rank of the stage
    blk: int  # one block's parameters on one rank
    root: int  # the root unit's parameters (embedding, final norm, head) on this stage
    p_gather: int  # what an FSDP all-gather of the stage materialises (routed experts of other EP ranks excluded)
    blk_gather: int
    accum: int
    n_mb: int  # pipeline micro-batches per micro-step (1 without PP)
    tokens: int  # this rank's tokens per (pipeline) micro-batch
    mix: dict  # AC kind -> blocks of this stage checkpointed that way
    kept: int  # blocks that keep their whole no-AC set
    compiled: bool
    norm_gains: int  # norm weights per block (not divided by TP)
    tied_head: bool
    held: float  # micro-batches in flight, in units of the rank's whole layer set
    by_kind: dict  # AC kind -> saved bytes per token of one block
    ft: PeftTerms | None = None  # fine-tuning (peft.method=lora/qlora) terms, dtlaunch.plan.peft
    mlp_tiles: int = 1  # training.mlp_tiles as resolved (config.layout.mlp_tiles): dtlaunch.plan.tiled_terms
    opt: OptimTerms | None = None  # the optimizer's state, temporaries and gradient dtype (plan.optim_terms)

    @property
    def v_h(self) -> int:
        return v_h(self.m, self.tp)

    @property
    def trained(self) -> int:
        """Parameters that train (have gradients and optimizer state): the adapters under LoRA / QLoRA."""
        return self.ft.adapters if self.ft else self.p_rank

    @property
    def trained_blk(self) -> int:
        return self.ft.adapters_block if self.ft else self.blk

    @property
    def grads(self) -> float:
        """Gradients of the stage's trained parameters (fp32, or bf16 adapters; sharded under FSDP)."""
        return self.grad_bytes * self.trained / (self.shard if self.fsdp else 1)

    @property
    def grad_bytes(self) -> int:
        return self.opt.grad_bytes if self.opt else 4

    @property
    def frozen_head_unit(self) -> bool:
        """The frozen, untied head is an FSDP2 unit of its own, gathered only while it runs: its forward,
        or the chunked loss run inside it; under tensor parallel a chunked loss reads it from the root
        unit (dtlaunch.config.layout.head_unit, which the runtime's dtlaunch.train.parallel.head_unit takes)."""
        return bool(self.ft) and self._head_unit(head_trains=False)

    @property
    def trained_head_unit(self) -> bool:
        """Full fine-tuning under FSDP2 with the chunked loss and no tensor parallel: the trained, untied
        head is a unit of its own, gathered only while the loss runs, its gradient reduce-scattered right
        after the loss's backward (dtlaunch.train.parallel.head_unit). The final norm stays in the root."""
        return bool(self.fsdp and self.ft is None) and self._head_unit(head_trains=True)

    def _head_unit(self, head_trains: bool) -> bool:
        """The runtime's decision (dtlaunch.train.parallel.head_unit), from the config."""
        return head_unit(head_trains, self.tied_head, owns_head=self.last, loss_chunks=loss_chunks(self), tp=self.tp)

    @property
    def head_unit(self) -> bool:
        """The untied head is an FSDP2 unit of its own, frozen or trained."""
        return self.frozen_head_unit or self.trained_head_unit

    @property
    def head_shard_grad(self) -> float:
        """The trained head unit's gradient shard from its reduce-scatter (right after the loss's backward)
        to the optimizer step: none where the accumulated gradients hold it already, CPU offload moves
        it to the host or the step inside backward frees it at once."""
        if not self.trained_head_unit or self.accum > 1 or offload.cpu_offload(self):
            return 0.0
        if self.opt and self.opt.in_backward:
            return 0.0
        return self.grad_bytes * self.v_h / self.shard

    @property
    def frozen_ends(self) -> int:
        """The frozen, untied embedding and head on this rank (LoRA / QLoRA) that are FSDP2 units of their
        own, gathered only while they run (dtlaunch.train.parallel.frozen_base)."""
        if not self.ft or self.tied_head:
            return 0
        return self.v_h * (int(self.first) + int(self.frozen_head_unit))


def v_h(m: Any, tp: int) -> int:
    """Parameters of the embedding (or of the output head) on one TP rank."""
    return m.vocab_size * m.dim // tp


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


def _block_tok(act: Any, kind: str, d: Any, e: int, t: Any, tp: int, sp: bool, autocast: bool, compiled: bool) -> float:
    """Saved bytes per token of one block under a checkpointing kind of `act.ac_mix`."""
    if kind == "budget":
        return act.block_bytes_budget(d, e, float(t.ac_memory_budget), tp, sp, autocast)
    return act.block_bytes(d, e, kind, tp, sp, autocast, compiled)


def stage_shape(
    cfg: Any, layout: Layout, stage: int, layers: int, first: bool, last: bool, layer_ids: list[int] | None = None
) -> StageShape:
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
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    sp = bool(s.sequence_parallel) and tp > 1
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    zero = int(s.zero_stage)
    # Context-parallel ranks hold the same parameters: FSDP / ZeRO shard (and DDP averages) over dp x cp.
    fsdp = shards_with_fsdp(cfg, layout)
    # The runtime casts with autocast wherever FSDP's MixedPrecisionPolicy does not (parallelize.compute_context).
    autocast = e != 4 and not fsdp
    # ... with an fp32 residual stream unless precision.residual_dtype keeps it in the compute dtype.
    residual32 = fp32_residual(cfg, layout)
    p_rank, blk, root = _stage_params(m, layers, first, last, tp)
    # Routed experts (MoE): whole on every TP rank; a gathered block holds only this rank's 1/ep of them.
    ids = layer_ids if layer_ids is not None else list(range(layers))
    routed = stage_routed_params(m, ids)
    if routed and tp > 1:
        p_rank += routed - routed // tp
        blk += (routed - routed // tp) // max(layers, 1)
    not_gathered = routed - routed // layout.ep
    n_mb = pp_microbatches(cfg, layout) if pp > 1 else 1
    mix = act.ac_mix(t, ids)
    compiled = bool(t.compile)
    by_kind = {k: _block_tok(act, k, d, e, t, tp, sp, residual32, compiled) for k in mix}
    if cp > 1 and fused_optimizer(cfg.hardware) and "none" in by_kind:
        # GPU context parallel: K/V heads are repeated to the query heads before torch's ring SDPA,
        # which then keeps the repeated copies for backward instead of the grouped ones.
        by_kind["none"] += e * 2 * (d.qw - d.k) / tp
    lora = str(cfg.peft.method) != "none"
    if lora and sp and "selective" in by_kind:
        # Fine-tuning: selective AC keeps as much per block with sequence parallel as without it
        # (measured, real 2-rank gloo runs, planner7m LoRA TP(2) bf16: 4,619 bytes per token and block
        # either way, the no-SP count plus the adapters' autocast casts, which go with the autocast
        # region): count it without SP (13 % under the measured peak with the SP count).
        by_kind["selective"] = _block_tok(act, "selective", d, e, t, tp, False, residual32, compiled)
    elif fsdp and sp and "selective" in by_kind:
        # Empirical (real FSDP x TP runs, MemTracker): selective AC under sequence parallel keeps one
        # gathered (full-sequence) hidden state per block that the op-level count does not explain.
        by_kind["selective"] += e * d.h
    # Fine-tuning: only the adapters train; QLoRA's base is NF4; the adapters join selective AC's matmul
    # alternation (dtlaunch.plan.peft).
    shard = layout.shard if fsdp or zero == 1 else 1
    ft = peft_terms(cfg, layers, tp, sp, shard if fsdp else 1, e, residual32, getattr(d, "routed_scale", 1.0))
    if ft and "selective" in by_kind and t.ac_policy == "op":
        by_kind["selective"] += ft.selective
    tiles = mlp_tiles(cfg, layout)
    if tiled(act, tiles) and "none" in by_kind:
        by_kind["none"] -= mlp_saved_bytes(d, e, tp, compiled)  # the tiled MLP saves nothing of its own
    per_rank_stages = int(s.pp_stages_per_rank) if pp > 1 else 1
    shape = StageShape(
        cfg=cfg,
        m=m,
        t=t,
        act=act,
        d=d,
        stage=stage,
        layers=layers,
        first=first,
        last=last,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=layout.ep,
        sp=sp,
        e=e,
        r=DTYPE_BYTES[cfg.precision.reduce_dtype],
        zero=zero,
        fsdp=fsdp,
        ddp=zero in (0, 1) and layout.dp * cp > 1,
        shard=shard,
        autocast=autocast,
        fp32_residual=residual32,
        p_rank=p_rank,
        blk=blk,
        root=root,
        p_gather=p_rank - not_gathered,
        blk_gather=blk - not_gathered // max(layers, 1),
        accum=grad_accum_steps(cfg, layout),
        n_mb=n_mb,
        # This rank's tokens: CP splits each sequence; a preference sample is two rows (dtlaunch.plan.objective).
        tokens=rows_per_sample(cfg) * (t.micro_batch // n_mb) * t.seq_len // cp,
        mix=mix,
        kept=mix.get("none", 0),
        compiled=compiled,
        norm_gains=spec.block_norm_params(m),
        tied_head=spec.head_params(m) == 0,
        held=in_flight(s.pp_schedule, pp, stage % pp, n_mb, per_rank_stages),
        by_kind=by_kind,
        ft=ft,
        mlp_tiles=tiles,
    )
    return dataclasses.replace(shape, opt=optim_terms(shape, fused_optimizer(cfg.hardware)))


def static_lines(c: StageShape) -> dict[str, float]:
    """What the rank holds through the whole step (before any activation)."""
    t, d, e, tp = c.t, c.d, c.e, c.tp
    lines: dict[str, float] = {}
    lines["parameters"] = 4 * c.p_rank / (c.shard if c.fsdp else 1)
    if c.ft:
        head = model_spec(c.m).head_params(c.m) // tp if c.last else 0
        embedding = c.v_h if c.first and not c.tied_head else 0  # stored in the compute dtype too
        frozen = c.layers * (c.blk - c.norm_gains) + head + embedding
        lines.update(param_lines(c.ft, c.p_rank, frozen, c.layers, c.shard if c.fsdp else 1, e, c.grad_bytes))
    rope_table = int(t.seq_len) * (d.head // 2)  # the runtime builds RoPE for training.seq_len positions
    lines["buffers"] = 2 * 4 * rope_table  # RoPE cos/sin, fp32
    if c.cp > 1:
        # The tables picked at this rank's token positions (Decoder.forward), shared by every block.
        lines["RoPE tables (CP positions)"] = 2 * (e if c.fsdp else 4) * (t.seq_len // c.cp) * (d.head // 2)
    if c.fsdp and e != 4:
        # The hidden state is in the compute dtype, so the model casts both tables to it once per forward
        # (llama.Llama.forward); every block shares that copy until backward is done.
        lines["RoPE tables (compute dtype)"] = 2 * e * rope_table
    lines["optimizer state"] = c.opt.state if c.opt else 8 * c.trained / c.shard
    lines.update(reference_static_lines(c))  # DPO's frozen reference copy
    if c.ddp:
        # DDP (gradient_as_bucket_view off) keeps flat fp32 buckets for the whole run; gradients are
        # separate tensors, allocated in backward and set to None after the step.
        lines["DDP buckets"] = 4 * c.trained
    if c.accum > 1:
        # Between accumulation micro-steps the gradients stay allocated: DDP's full .grad; FSDP
        # reduce-scatters every micro-step (dtlaunch.train.step.grad_sync) and keeps only shards.
        lines["accumulated gradients"] = c.grads
    copies = _autocast_weight_copies(c)
    if copies is not None and c.last and loss_chunks(c) > 1 and (not c.ft or c.tied_head):
        copies -= e * c.v_h  # a chunked loss casts the head per chunk instead (dtlaunch.plan.loss_terms)
    if copies is not None:
        lines["autocast weight copies"] = copies
    if c.fsdp and c.zero == 2:
        lines["unsharded parameters"] = e * c.p_gather if (c.shard > 1 or e != 4) else 0.0
        if c.ft:
            lines["unsharded parameters"] += c.layers * (gathered_block(c.ft, c.blk, e) - e * c.blk) - e * c.frozen_ends
        if c.trained_head_unit:
            lines["unsharded parameters"] -= e * c.v_h  # resharded after the loss, unlike the root unit
    elif c.fsdp:
        # The root unit is not resharded after forward; measured (real gloo runs, MemTracker): its
        # head and final norm stay gathered until backward, the embedding's gathered copy does not add.
        # A frozen embedding and head, and a trained head under the chunked loss, are units of their own,
        # resharded after use.
        ends = c.v_h if c.head_unit else 0
        lines["unsharded parameters"] = e * (c.root - (c.v_h if c.first else 0) - ends)
    if c.cfg.precision.float8 != "none":
        # torchao's Float8Linear saves its input and the parameter itself (no compute-dtype weight copy:
        # it casts to float8 inside), so only the head, still a plain linear, keeps an autocast copy; on
        # top, one linear at a time holds float8 (1-byte) copies of its input and weight and their
        # transposes, bounded by the widest (F-wide) linear and split by TP like the linear itself.
        if "autocast weight copies" in lines:
            lines["autocast weight copies"] = min(lines["autocast weight copies"], e * c.v_h if c.last else 0.0)
        lines["float8 casts"] = 2 * (c.tokens + d.h) * d.f / tp
    return lines


def _autocast_weight_copies(c: StageShape) -> float | None:
    """Compute-dtype copies of the weights that autocast's matmuls save for backward (None: no line)."""
    e, layers, kept = c.e, c.layers, c.kept
    if not c.autocast:
        return None
    if c.ft:
        # Frozen linears are stored in the compute dtype (their cast is the weight itself), QLoRA's NF4
        # matmuls save the NF4 weight: only the adapters' casts (and a tied head's) are copies.
        # bf16 adapters (optim.state_dtype=bf16) are their own cast.
        adapters = c.ft.adapters if kept == layers and not c.compiled and c.grad_bytes == 4 else 0
        return e * (adapters + (c.v_h if c.tied_head and c.last else 0))
    if kept and c.compiled:
        # Compiled blocks recompute their weights' casts in backward instead of saving them.
        return e * c.v_h if c.last else 0.0
    if kept == layers:
        # Each weight's compute-dtype copy (not the embedding's, nor norm gains) is saved by its matmul
        # from forward to backward; under AC the casts are recomputed with the block instead.
        # A tied matrix is also the head, a matmul weight: its cast is saved as well.
        head_cast = c.v_h if c.tied_head and c.last else 0
        return e * (c.p_rank - (c.v_h if c.first else 0) - c.norm_gains * layers + head_cast)
    if kept:  # layer policy: the blocks it does not checkpoint keep their copies
        return e * (kept * (c.blk - c.norm_gains) + (c.v_h if c.last else 0))
    if c.last:
        return e * c.v_h
    return None


def _loss_saved_per_token(c: StageShape) -> float:
    """The last stage's final norm and logits, saved for the loss backward (per token)."""
    if not c.last:
        return 0.0
    final_norm = c.ft.final_norm if c.ft else c.act.final_norm_bytes(c.d, c.e, c.tp, c.sp, c.fp32_residual)
    return final_norm + logits_saved_per_token(c)


def _blocks_per_token(c: StageShape) -> float:
    """Saved bytes per token of the stage's blocks; under fine-tuning the frozen base keeps less (frozen
    norm gains; the first block's input needs no gradient), the adapters' own are a line of their own."""
    per_token = sum(n * c.by_kind[k] for k, n in c.mix.items())
    if c.ft:
        per_token += c.kept * c.ft.act_block + (c.ft.act_first if c.first and c.kept else 0.0)
    return per_token


def _mean_block_per_token(c: StageShape) -> float:
    """Saved bytes per token of the stage's mean block."""
    return _blocks_per_token(c) / c.layers if c.layers else 0.0


def forward_lines(c: StageShape) -> dict[str, float]:
    """What forward adds: saved activations of every micro-batch in flight, all-to-all buffers (EP)."""
    t = c.t
    per_token = _blocks_per_token(c)
    if c.first:
        per_token += c.act.embedding_bytes(c.d, c.e)
    per_token += _loss_saved_per_token(c)
    # Under autocast the hidden state stays fp32 and each block's RoPE casts its own table slices.
    rope = (
        c.act.rope_cast_bytes(c.d, c.e, int(t.seq_len) // c.cp) * c.kept if c.fp32_residual and not c.compiled else 0.0
    )
    lines = {"activations": (per_token * c.tokens + rope * (t.micro_batch // c.n_mb) / t.micro_batch) * c.held}
    if c.ft:
        lines["LoRA activations"] = c.kept * c.ft.adapter_act * c.tokens * c.held
    a2a = all_to_all_bytes(c.cfg, c.ep, c.tokens, c.e)
    if a2a:
        lines["all-to-all buffers"] = a2a
    return lines


def backward_peak(c: StageShape, lines: dict[str, float]) -> float:
    """The largest backward moment, given the static and forward lines."""
    d, e, r, tp, layers, tokens = c.d, c.e, c.r, c.tp, c.layers, c.tokens
    fsdp, zero, first, last = c.fsdp, c.zero, c.first, c.last
    div = c.shard if fsdp else 1
    in_backward = bool(c.opt and c.opt.in_backward)
    base = sum(lines.values())
    # Blocks' saved bytes per token still on the device (training.activation_offload moves the rest).
    blk_tok = _mean_block_per_token(c) - (offload.moved_per_token(c) / layers if layers else 0.0)
    # Two moments: (1) log_softmax's backward on the last stage (everything forward kept + the fp32 loss
    # gradients), (2) inside a block's backward: its recompute set, activation gradients, its unsharded
    # parameters (+ the prefetched next block) and gradients, and the gradients already produced. (2) is
    # taken at the first block processed (most activations still held) and at the last (most gradients
    # produced).
    loss_bwd = loss_backward_bytes(c)  # full or chunked loss (dtlaunch.plan.loss_terms)
    head_grads = (4 * (c.v_h + d.h) if last else 0.0) / div
    unit = 0.0
    if fsdp:
        # The block being differentiated: its gathered parameters (ZeRO-3) and unsharded gradients
        # (+ their reduce-dtype copy). Measured: the prefetched next block does not add at the peak.
        unit = (e * c.blk_gather if zero == 3 else 0.0) + (e + (r if r != e else 0)) * c.blk_gather
        unit += offload.staging_bytes(c)  # CPU offload: the unit's fp32 shard copied in to be gathered
        head_grads = (e * (c.v_h + d.h) if last else 0.0) if zero == 3 else head_grads
        if c.trained_head_unit:
            # The head's gradient was reduce-scattered at its unit's post-backward, right after the loss's
            # backward: its shard stays; the final norm's unsharded gradient waits for the root's.
            head_grads = c.head_shard_grad + (e * d.h if zero == 3 else 4 * d.h / div)
        if c.ft:
            gathered = gathered_block(c.ft, c.blk_gather, e) if zero == 3 else 0.0
            unit = gathered + (e + (r if r != e else 0)) * c.trained_blk
    if c.ft:
        head_grads = 0.0  # the head and final norm are frozen
    # The block being recomputed: the most any checkpointed kind of this stage re-creates at once.
    none_tok = c.act.block_bytes_no_ac(d, e, tp, c.sp, c.fp32_residual, c.compiled)
    recompute = max((none_tok - c.by_kind[k] for k in c.mix if k != "none" and c.mix[k]), default=0.0)
    work = (c.act.backward_working_bytes(d, e, tp) + recompute) * tokens
    if tiled(c.act, c.mlp_tiles):  # dtlaunch.plan.tiled_terms
        none_tok -= mlp_saved_bytes(d, e, tp, c.compiled)
        recompute = max((none_tok - c.by_kind[k] for k in c.mix if k != "none" and c.mix[k]), default=0.0)
        grads = c.act.backward_working_bytes(d, e, tp) + tile_working_bytes(d, e, tp, c.mlp_tiles)
        work = (grads + recompute) * tokens + grad_sum_bytes(d, c.grad_bytes, tp, not c.ft)
    if c.ft and c.ft.qlora:
        work += c.ft.dequant  # one NF4 weight dequantised for its matmul
    if c.cp > 1:
        # Every row of the micro-batch (a preference pair is two: real 2-rank gloo DPO runs, CP(2), were
        # 3 % under with the exchange of one row per sample).
        work += backward_exchange_bytes(c)
    if c.autocast and c.kept < layers:
        work += e * (c.ft.adapters_block if c.ft else c.blk - c.norm_gains)  # the recomputed block casts its weights
    # The loss backward frees the final norm's and log_softmax's saved tensors of its own micro-batch
    # only: under a pipeline the other micro-batches in flight keep theirs. (Subtracting them for every
    # micro-batch in flight put GPipe's last stage 13 % under real gloo runs.)
    held_act = lines["activations"] - (_loss_saved_per_token(c) * tokens if last else 0.0)
    held_act += held_logits(c)  # a full pass's logits stay referenced until backward returns
    blk_grads = (c.grad_bytes * c.trained_blk / div) if layers else 0.0
    if offload.cpu_offload(c) and c.accum == 1:
        # Each block's gradient shard becomes the host gradient as its reduce-scatter ends (with
        # accumulation it stays on the device until it is added into the host's: measured on gloo runs).
        blk_grads = 0.0
    at_first_blk = base - lines["activations"] + held_act + head_grads + unit + work + blk_grads
    at_first_blk += offload.reloaded_block(c)  # activation offload: the block's saved set back from the host
    at_first_blk += regathered_root(c)  # a chunked loss's gather of the root unit (dtlaunch.plan.loss_terms)
    if c.ft and fsdp and zero == 3 and layers > 1:
        # Fine-tuning: the next block's unit, prefetched by the block's pre-backward (FSDP2 gathers the
        # unit that ran before it in forward), is already gathered at the first block's peak: a traced
        # CPU run (`plan --trace`, planner7m LoRA / QLoRA ZeRO-3) has one gathered block in "Unsharded
        # Param" and one in "All Gather". (Full training's larger gradients put its peak after the
        # prefetch is consumed.) The frozen embedding's unit is prefetched only by the last block
        # processed, when the activations are gone, and the frozen head's after the loss: neither adds.
        # Under expert parallel the traced peak (planner_moe LoRA ZeRO-3, EP 2) holds one gathered block
        # and nothing in "All Gather": counting the prefetch put the real run 5 % over.
        at_first_blk += gathered_block(c.ft, c.blk_gather, e) if c.ep == 1 else 0.0
    # Gradients produced since the first block: with accumulation they already exist from the earlier
    # micro-steps (the "accumulated gradients" line) and are added into in place, so nothing grows.
    # (Counting them again put Llama-3.1-70B FSDP x TP, 16 micro-steps, 12 % over its trace.)
    # (Under CPU offload each block's gradient shard leaves for the host: nothing grows on the device.)
    grows = c.accum == 1 and not offload.cpu_offload(c) and not in_backward
    grown = max(0, layers - 1) * blk_grads if grows else 0.0
    if in_backward:
        # The update of one tensor runs inside backward, its gradient freed right after: a block's inside
        # the block's backward, the root unit's (embedding, head) after the last block's.
        at_first_blk += c.opt.temp_block
    at_last_blk = at_first_blk - (layers - 1) * blk_tok * tokens * c.held + grown
    if c.trained_head_unit:
        # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward: the head's stays
        # through the first block's backward (traced, Llama-3.1-8B ZeRO-3: 6 % under without it).
        at_first_blk += c.r * c.v_h
    if in_backward:
        at_last_blk += c.opt.temp - c.opt.temp_block
    if first and fsdp and zero == 3 and not c.ft:  # (a frozen embedding has no gradient)
        at_last_blk += e * c.v_h  # the embedding's unsharded gradient before its reduce-scatter
    elif first and c.accum == 1 and not c.ft:
        at_last_blk += 4 * c.v_h / div
    backward = [base + loss_bwd, at_first_blk if layers else 0.0, at_last_blk if layers else 0.0]
    backward.append(_root_reduce_moment(c, lines, layers * blk_grads if grows else 0.0))
    backward.append(_head_reduce_moment(c, base))
    if c.pp > 1 and c.n_mb > 1:
        backward += _later_microbatch_moments(c, lines, base, loss_bwd, at_first_blk, blk_grads, head_grads, blk_tok)
    return max(backward)


def _embedding_gather_moment(c: StageShape, lines: dict[str, float]) -> float:
    """FSDP2's all-gather of a frozen embedding's own unit (LoRA / QLoRA) at the start of forward: the flat
    all-gather output and the unsharded storage it is copied into exist together, next to the root's
    gathered head; gloo's all-gather (a CPU profile) holds one more full-size copy, NCCL does not.
    Measured (real gloo runs, tiny model, 32k vocabulary, LoRA ZeRO-3): 3 x the embedding. With the
    chunked loss, which no longer holds a chunk's logits in backward, this can be the step's peak."""
    if not (c.fsdp and c.ft and c.first and c.v_h) or c.tied_head:
        return 0.0
    static = sum(lines.values()) - lines.get("activations", 0.0)
    gloo = gloo_collectives(c.cfg.hardware)
    return static + (3 if gloo else 2) * c.e * c.v_h


def _root_reduce_moment(c: StageShape, lines: dict[str, float], block_grads: float) -> float:
    """FSDP's reduce-scatter of the root unit (embedding, final norm, head) at the end of backward. Every
    activation is freed by then and the blocks' gradient shards exist (`block_grads`, when they grow in
    this micro-step). The root's unsharded gradients are copied into a flat reduce-dtype input (e + r
    bytes per parameter), then that input sits next to its reduce-dtype output shard (r + r / shard);
    gloo's reduce-scatter (a CPU profile) copies its input once more, NCCL does not. A frozen root (LoRA)
    has no gradient. With a full-vocabulary loss this is seldom the peak; with the chunked loss, whose
    gradients are taken in forward, it can be."""
    if not (c.fsdp and c.root and c.ft is None):
        return 0.0
    root = c.root - (c.v_h if c.trained_head_unit else 0)  # the head's own unit was reduced already
    static = sum(lines.values()) - lines["activations"] + c.head_shard_grad
    if c.zero == 2:
        # ZeRO-2's blocks were resharded after their own backward: what stays gathered is what ZeRO-3
        # holds, the root's head and final norm (measured: the embedding's gathered copy does not add).
        held = c.e * (root - (c.v_h if c.first else 0))
        static -= max(0.0, lines.get("unsharded parameters", 0.0) - held)
    return static + block_grads + _reduce_per_param(c) * root


def _reduce_per_param(c: StageShape) -> float:
    """Bytes per parameter at an FSDP unit's reduce-scatter: its unsharded gradients copied into a flat
    reduce-dtype input (e + r), then that input next to its output shard (r + r / shard); gloo's
    reduce-scatter (a CPU profile) copies its input once more, NCCL does not."""
    gloo = gloo_collectives(c.cfg.hardware)
    return max(c.e + c.r, c.r + c.r / c.shard + (c.r if gloo else 0))


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
    buffer = c.e if c.zero == 3 else 0
    return base + (buffer + c.e + c.r + c.r / c.shard + (c.r if gloo else 0)) * c.v_h


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
    s, e, r, layers, tokens, zero = c.cfg.strategy, c.e, c.r, c.layers, c.tokens, c.zero
    per_mb = lines["activations"] / c.held
    fewer = per_mb if c.held >= c.n_mb else 0.0
    # 1F1B's steady state runs a forward between two backwards, which reshards the blocks (ZeRO-3);
    # GPipe's backwards follow one another, so what a backward left gathered stays gathered.
    fresh = c.held < c.n_mb
    all_grads = c.grads if c.accum == 1 else 0.0  # with accumulation they are in `base` already
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
        gathered = e * c.p_gather - lines.get("unsharded parameters", 0.0) if zero == 3 else 0.0
        # `unit` holds the block's gathered parameters (in `gathered`), the compute-dtype gradient it
        # has just produced (a transient before it is added in) and, with a reduce dtype other than
        # the compute dtype, the accumulated copy (in r * p_gather). Measured (fake-tensor trace,
        # planner7m FSDP(2) x PP(2), 1F1B, fp32): the transient is in the peak.
        in_unit = (e * c.blk_gather if zero == 3 else 0.0) + (r * c.blk_gather if r != e else 0.0)
        all_grads = r * c.p_gather + gathered - (in_unit if layers else 0.0)
        if layers:
            # The first micro-batch's backward at its last block: every block before it left its
            # unsharded gradients and (ZeRO-3) its gathered parameters. Measured (real gloo runs,
            # planner7m FSDP(2) x PP(2), GPipe): the last stage's peak (13 % under without it).
            kept = r * c.blk_gather + (e * c.blk_gather if zero == 3 else 0.0)
            moments.append(at_first_blk - blk_grads + (layers - 1) * (kept - blk_tok * tokens))
    if layers and c.fsdp and s.pp_reshard_grads:
        # Every micro-batch's backward reduce-scatters block by block. At a block's reduce-scatter its
        # unsharded gradients are copied into FSDP's flat reduce-scatter input while still referenced:
        # with a reduce dtype other than the compute dtype that copy is `unit`'s reduce-dtype term,
        # otherwise an extra one (fake-tensor trace, fp32: the first micro-batch 6 % over
        # `at_first_blk` without it).
        rs_copy = r * c.blk if r == e else 0.0
        moments.append(at_first_blk + rs_copy)
        # A later one: also the sharded gradients of every block from the earlier micro-batches, the
        # block's fresh shard before it is added into them, the root unit's unsharded gradient (head)
        # until its post-backward and, on the first stage, the root's parameters gathered again
        # (resharded after the previous backward). Measured on real gloo runs (planner7m,
        # FSDP(2) x PP(2), 1F1B, fp32 and bf16): both stages within 3 %.
        regathered = e * c.v_h if c.first and zero == 3 else 0.0
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
    if c.last:
        # At a later micro-batch's loss backward: every gradient of the stage. Under 1F1B the blocks'
        # parameters are sharded again (that micro-batch's forward resharded them); measured
        # (fake-tensor trace, Llama-3.1-8B FSDP(2) x PP(4), last stage): 12 % over without this.
        # Under GPipe they stay gathered from the previous backward.
        moments.append(base + loss_bwd + all_grads + in_unit - (gathered if fresh else 0.0) - fewer)
    return moments


def optimizer_lines(c: StageShape, lines: dict[str, float]) -> dict[str, float]:
    """At the optimizer step: activations and unsharded buffers are gone; gradients are complete, and
    foreach AdamW (CPU) allocates one temporary the size of the local fp32 state."""
    out = {k: v for k, v in lines.items() if k not in _GONE_AT_OPTIMIZER}
    if c.opt and c.opt.in_backward:
        return out  # every update ran inside backward; no gradient is left
    out["gradients"] = c.grads
    temp = c.opt.temp if c.opt else (0.0 if fused_optimizer(c.cfg.hardware) else 4 * c.trained / c.shard)
    if temp:
        out["optimizer temporaries"] = temp
    return out


def plan_stage(
    cfg: Any, layout: Layout, stage: int, layers: int, first: bool, last: bool, layer_ids: list[int] | None = None
) -> StagePlan:
    """The stage's plan: its lines at the peak phase, and every phase's total."""
    c = stage_shape(cfg, layout, stage, layers, first, last, layer_ids)
    static = static_lines(c)
    # Offloading (dtlaunch.plan.offload): the device lines shrink by exactly what the host lines hold.
    lines, host = offload.split(c, {**static, **forward_lines(c)})
    at_step, host_at_step = offload.split_at_step(c, optimizer_lines(c, lines))
    phases = {"forward": sum(lines.values()), "backward": backward_peak(c, lines), "optimizer": sum(at_step.values())}
    gather = _embedding_gather_moment(c, lines)
    phases["forward"] = max(phases["forward"], gather)
    phases.update(reference_phases(c, static))  # DPO: the reference forward, or the precompute pass
    phases.update(generation_phases(c, static))  # GRPO: the rollout's generation and old-policy pass
    phase = max(phases, key=lambda k: phases[k])
    if phase == "forward" and gather == phases["forward"]:
        lines = {k: v for k, v in lines.items() if k != "activations"}
        lines["all-gather buffers"] = gather - sum(lines.values())
    if phase == "backward":
        lines["loss/backward buffers"] = phases["backward"] - phases["forward"]
    if phase == "optimizer":
        lines = at_step
    if phase == PHASE_GENERATION:
        lines = generation_lines(c, static)
    elif phase not in ("forward", "backward", "optimizer"):
        lines = {**static, "reference forward buffers": phases[phase] - sum(static.values())}
    return StagePlan(
        stage=stage,
        layers=layers,
        params=c.p_rank,
        lines=lines,
        phases=phases,
        phase=phase,
        peak=phases[phase],
        host=offload.host_peak_lines(host, host_at_step),
    )


def _likely_worst(split: list[int], pp: int) -> set[int]:
    """Ranks that can hold the peak: the first (embedding, most in flight), the second (in flight),
    the last (logits) and the one with the most layers."""
    most = max(range(pp), key=lambda r: (split[r] * (pp - r), -r))
    return {0, min(1, pp - 1), pp - 1, most}


def plan_stages(cfg: Any, layout: Layout, all_stages: bool = True) -> list[StagePlan]:
    """Every pipeline rank's plan (or, for the search, only those that can hold the peak)."""
    s = cfg.strategy
    per_rank = int(s.pp_stages_per_rank) if layout.pp > 1 else 1
    n_stages = layout.pp * per_rank
    split = pp_stage_layers(cfg.model.n_layers, n_stages, list(s.pp_layers_per_stage) or None)
    ranks = range(layout.pp) if all_stages or per_rank > 1 else sorted(_likely_worst(split, layout.pp))
    starts = list(itertools.accumulate(split, initial=0))  # each stage's first global block index
    stages = []
    for rank in ranks:
        # A rank owns stages rank, rank + pp, ... (interleaved); add its chunks up as one rank.
        owned = list(range(rank, n_stages, layout.pp))
        layers = sum(split[i] for i in owned)
        ids = [b for i in owned for b in range(starts[i], starts[i + 1])]  # global block indices
        stages.append(
            plan_stage(cfg, layout, rank, layers, first=0 in owned, last=n_stages - 1 in owned, layer_ids=ids)
        )
    return stages
