"""The shape of one pipeline stage's plan: every degree, dtype size, parameter and token count the
planner's phases read (dtlaunch.plan.stage, dtlaunch.plan.backward and the *_terms modules).

Units are in each field's name or docstring: `*_bytes` are bytes (per element where it says so),
`*_params` are parameter counts (elements) on one rank, `tokens` are tokens, `*_per_token` bytes per
token. The shape is built once per stage from the config and the layout (`stage_shape`); the phases
never read the config for something the shape has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtlaunch.config.decisions import Decisions, fused_optimizer, head_unit
from dtlaunch.config.schema import CpStyle, ObjectiveName
from dtlaunch.models.dtypes import DTYPE_BYTES
from dtlaunch.models.registry import model_spec
from dtlaunch.plan import offload
from dtlaunch.plan.experts import grouped_gemm, rank_imbalance, stage_routed_params, stage_whole_under_tp
from dtlaunch.plan.loss_terms import logits_saved_per_token, loss_chunks
from dtlaunch.plan.optim_terms import OptimTerms, optim_terms
from dtlaunch.plan.peft import PeftTerms, peft_terms
from dtlaunch.plan.tiled_terms import mlp_saved_bytes, tiled

if TYPE_CHECKING:
    from dtlaunch.config.layout import Layout
    from dtlaunch.config.schema import JobConfig, ModelConfig, TrainingConfig

# Measured corrections (each names the test that measures it; tests/unit/test_plan_corrections.py checks
# that the test exists and sees the term).
# Selective AC under FSDP x sequence parallel keeps this many gathered (full-sequence) hidden states per
# block that the op-level count does not explain (real FSDP x TP runs, MemTracker).
# Measured by tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace
FSDP_SP_SELECTIVE_HIDDEN_STATES = 1
# Selective AC under tensor parallel x sequence parallel without FSDP keeps this many gathered (full-sequence)
# hidden states per block, and one sequence-shard of it (1/tp), more than the op-level count: (1 + 1/tp)·e·h per
# token and block (real gloo runs: llama and qwen3 at h = 64 and 128, tp = 2 and 4, and the Gated DeltaNet hybrids:
# exact). Fine-tuning keeps its own measured rule (LORA_SELECTIVE_COUNTED_WITHOUT_SP).
# Measured by tests/distributed/test_gated_deltanet_tp_activations.py::test_tensor_parallel_ranks_keep_what_the_plan_counts
TP_SP_SELECTIVE_GATHERED_HIDDEN_STATES = 1
# Fine-tuning: selective AC keeps as much per block with sequence parallel as without it (real 2-rank gloo
# runs, planner7m LoRA TP(2) bf16: 4,619 bytes per token and block either way; the SP count was 13 % under).
# Measured by tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace
LORA_SELECTIVE_COUNTED_WITHOUT_SP = True


@dataclass(frozen=True)
class StageShape:
    """What every phase of one stage's plan reads: the most loaded rank of pipeline rank `stage`."""

    cfg: JobConfig  # the whole job config (for the few sections a term reads itself)
    decisions: Decisions  # what the job decides once (config.decisions): the runtime reads the same
    model: Any  # the model section (cfg.model)
    training: Any  # the training section (cfg.training)
    activation_model: Any  # the model family's activation model (dtlaunch.models.*.activations)
    block_dims: Any  # its block dimensions (activation_model.BlockDims: h, f, qw, k, head, vocab, ...)
    stage: int  # the pipeline rank
    layers: int  # blocks on this rank (every virtual stage it owns)
    first_stage: bool  # owns the embedding (pipeline stage 0)
    last_stage: bool  # owns the final norm, the output head and the loss
    tp: int  # tensor-parallel degree (strategy.tp)
    pp: int  # pipeline-parallel degree (strategy.pp)
    cp: int  # context-parallel degree (strategy.cp)
    ep: int  # expert-parallel degree (strategy.ep)
    sequence_parallel: bool  # strategy.sequence_parallel and tp > 1
    compute_bytes: int  # bytes per element of the compute dtype (precision.param_dtype)
    reduce_bytes: int  # bytes per element of the gradient-reduce dtype (precision.reduce_dtype)
    zero_stage: int  # strategy.zero_stage
    ddp: bool  # DDP over more than one rank (ZeRO 0 / 1)
    shard_ranks: int  # ranks the optimizer state (and FSDP's parameters) are sharded over
    rank_params: int  # parameters on one rank of the stage (after TP division)
    block_params: int  # one block's parameters on one rank
    root_params: int  # the root unit's parameters (embedding, final norm, head) on this stage
    gathered_params: int  # what an FSDP all-gather of the stage materialises (other EP ranks' experts excluded)
    gathered_block_params: int  # ... of one block
    pp_microbatches: int  # pipeline micro-batches per micro-step (1 without PP)
    tokens: int  # this rank's tokens per (pipeline) micro-batch
    ac_mix: dict  # AC kind -> blocks of this stage checkpointed that way
    blocks_without_ac: int  # blocks that keep their whole no-AC saved set
    compiled: bool  # training.compile
    block_norm_params: int  # norm weights per block (not divided by TP)
    tied_head: bool  # the output head is the embedding's matrix
    microbatches_in_flight: float  # micro-batches whose activations are held at once, in units of the rank's layer set
    block_saved_per_token: dict  # AC kind -> saved bytes per token of one block
    peft: PeftTerms | None = None  # fine-tuning (peft.method=lora/qlora) terms, dtlaunch.plan.peft
    optim: OptimTerms | None = None  # the optimizer's state, temporaries and gradient dtype (plan.optim_terms)
    scalar_head: bool = False  # objective=reward: the (dim x 1) score head in place of the LM head

    @property
    def fsdp(self) -> bool:
        """Parameters sharded by FSDP2."""
        return self.decisions.fsdp

    @property
    def autocast(self) -> bool:
        """The compute dtype comes from autocast, not from FSDP's mixed-precision policy."""
        return self.decisions.autocast

    @property
    def fp32_residual(self) -> bool:
        """The residual stream in fp32 under autocast."""
        return self.decisions.fp32_residual

    @property
    def accum_steps(self) -> int:
        """Gradient-accumulation micro-steps per optimizer step."""
        return self.decisions.grad_accum

    @property
    def mlp_tiles(self) -> int:
        """training.mlp_tiles as resolved: dtlaunch.plan.tiled_terms."""
        return self.decisions.mlp_tiles

    @property
    def full_trained_params(self) -> int:
        """Parameters trained in full beside the adapters (LoRA / QLoRA): a reward model's score head (peft's
        modules_to_save, dtlaunch.models.score_head) on the stage that owns it."""
        return int(self.model.dim) if self.peft and self.scalar_head and self.last_stage else 0

    @property
    def vocab_params(self) -> int:
        """Parameters of the embedding (or of the untied output head) on one TP rank."""
        return vocab_params(self.model, self.tp)

    @property
    def trained_params(self) -> int:
        """Parameters that train (have gradients and optimizer state): the adapters under LoRA / QLoRA (and
        the modules trained in full beside them)."""
        return self.peft.adapters + self.full_trained_params if self.peft else self.rank_params

    @property
    def trained_block_params(self) -> int:
        """One block's trained parameters on one rank."""
        return self.peft.adapters_block if self.peft else self.block_params

    @property
    def gradient_bytes(self) -> float:
        """Bytes of the stage's trained parameters' gradients (fp32, or bf16 adapters; sharded under FSDP)."""
        return self.grad_element_bytes * self.trained_params / (self.shard_ranks if self.fsdp else 1)

    @property
    def grad_element_bytes(self) -> int:
        """Bytes per gradient element of a trained parameter."""
        return self.optim.grad_bytes if self.optim else 4

    @property
    def frozen_head_unit(self) -> bool:
        """The frozen, untied head is an FSDP2 unit of its own, gathered only while it runs: its forward,
        or the chunked loss run inside it; under tensor parallel a chunked loss reads it from the root
        unit (dtlaunch.config.decisions.head_unit, which the runtime's dtlaunch.train.parallel.head_unit takes)."""
        return bool(self.peft) and self._head_unit(head_trains=False)

    @property
    def trained_head_unit(self) -> bool:
        """Full fine-tuning under FSDP2 with the chunked loss and no tensor parallel: the trained, untied
        head is a unit of its own, gathered only while the loss runs, its gradient reduce-scattered right
        after the loss's backward (dtlaunch.train.parallel.head_unit). The final norm stays in the root."""
        return bool(self.fsdp and self.peft is None) and self._head_unit(head_trains=True)

    def _head_unit(self, head_trains: bool) -> bool:
        """The runtime's decision (dtlaunch.train.parallel.head_unit), from the config."""
        return head_unit(
            head_trains, self.tied_head, owns_head=self.last_stage, loss_chunks=loss_chunks(self), tp=self.tp
        )

    @property
    def head_unit(self) -> bool:
        """The untied head is an FSDP2 unit of its own, frozen or trained."""
        return self.frozen_head_unit or self.trained_head_unit

    @property
    def head_grad_shard_bytes(self) -> float:
        """Bytes of the trained head unit's gradient shard from its reduce-scatter (right after the loss's backward)
        to the optimizer step: none where the accumulated gradients hold it already, CPU offload moves
        it to the host or the step inside backward frees it at once."""
        if not self.trained_head_unit or self.accum_steps > 1 or offload.cpu_offload(self):
            return 0.0
        if self.optim and self.optim.in_backward:
            return 0.0
        return self.grad_element_bytes * self.vocab_params / self.shard_ranks

    @property
    def frozen_end_params(self) -> int:
        """Parameters of the frozen, untied embedding and head on this rank (LoRA / QLoRA) that are FSDP2 units of their
        own, gathered only while they run (dtlaunch.train.parallel.frozen_base)."""
        if not self.peft or self.tied_head:
            return 0
        return self.vocab_params * (int(self.first_stage) + int(self.frozen_head_unit))


def vocab_params(m: ModelConfig, tp: int) -> int:
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


def _stage_params(
    m: ModelConfig, layers: int, first: bool, last: bool, tp: int, scalar_head: bool = False
) -> tuple[int, int, int]:
    """(params on one TP rank of the stage, one block's params, the root unit's params: embedding,
    final norm, output head on the stages that own them). Matrices divide by tp, norm weights not.
    `scalar_head`: objective=reward's (dim x 1) score in place of the LM head (no tp, no pp)."""
    spec = model_spec(m)
    blk_norms = spec.block_norm_params(m)
    blk = (spec.block_params(m) - blk_norms) // tp + blk_norms
    root = 0
    if first:
        root += spec.embedding_params(m) // tp
    if last and scalar_head:
        root += 2 * m.dim  # the score head and the final norm
    elif last:
        # A tied head is the embedding's matrix: counted once (tied models refuse pp > 1).
        root += spec.head_params(m) // tp + m.dim
        if spec.head_params(m) == 0 and not first:
            root += spec.embedding_params(m) // tp
    return layers * blk + root, blk, root


def block_saved_bytes(
    act: Any, kind: str, d: Any, e: int, t: TrainingConfig, tp: int, sp: bool, autocast: bool, compiled: bool
) -> float:
    """Saved bytes per token of one block under a checkpointing kind of `act.ac_mix`."""
    if kind == "budget":
        return act.block_bytes_budget(d, e, float(t.ac_memory_budget), tp, sp, autocast)
    return act.block_bytes(d, e, kind, tp, sp, autocast, compiled)


def stage_shape(
    cfg: JobConfig, layout: Layout, stage: int, layers: int, first: bool, last: bool, layer_ids: list[int] | None = None
) -> StageShape:
    m, s, t = cfg.model, cfg.strategy, cfg.training
    spec = model_spec(m)
    act = spec.act()
    d = act.BlockDims.of(m)
    if getattr(d, "experts", 0):  # (a hybrid family's dense variant has the MoE fields, no experts)
        d = dataclasses.replace(d, grouped=grouped_gemm(cfg))
    if hasattr(d, "seq"):  # terms that depend on the row's length (the Gated DeltaNet's chunk padding)
        d = dataclasses.replace(d, seq=int(t.seq_len) // max(layout.cp, 1))
    if hasattr(d, "cp"):  # blocks that run on the whole row under Ulysses CP (the Gated DeltaNet's rule)
        d = dataclasses.replace(d, cp=max(layout.cp, 1))
    if layout.ep > 1 and hasattr(d, "routed_scale"):
        # Expert parallel: a rank computes the copies routed to its experts, the busiest rank more than the
        # balanced share.
        d = dataclasses.replace(d, routed_scale=rank_imbalance(cfg, layout.ep), ep=layout.ep)
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    sp = bool(s.sequence_parallel) and tp > 1
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    zero = int(s.zero_stage)
    # Context-parallel ranks hold the same parameters: FSDP / ZeRO shard (and DDP averages) over dp x cp.
    dec = Decisions.of(cfg, layout)
    fsdp = dec.fsdp
    # The runtime casts with autocast wherever FSDP's MixedPrecisionPolicy does not (parallelize.compute_context),
    # with an fp32 residual stream unless precision.residual_dtype keeps it in the compute dtype.
    residual32 = dec.fp32_residual
    reward = cfg.objective.name == ObjectiveName.reward
    if reward:  # the scalar head's (tokens x 1) scores take the place of the logits (dtlaunch.train.objectives.reward)
        d = dataclasses.replace(d, vocab=1)
    p_rank, blk, root = _stage_params(m, layers, first, last, tp, scalar_head=reward)
    # Routed experts (MoE): split on their width by TP like the other matrices, but the router (and
    # gpt-oss's down biases) whole on every TP rank; a gathered block holds only its 1/ep of the experts.
    ids = layer_ids if layer_ids is not None else list(range(layers))
    routed = stage_routed_params(m, ids)
    whole = stage_whole_under_tp(m, ids)
    if whole and tp > 1:
        p_rank += whole - whole // tp
        blk += (whole - whole // tp) // max(layers, 1)
    if hasattr(d, "fe") and tp > 1:  # a TP rank's slice of each routed and shared expert
        d = dataclasses.replace(d, fe=d.fe // tp, fs=d.fs // tp)
    not_gathered = routed - routed // layout.ep
    n_mb = dec.pp_microbatches if pp > 1 else 1
    mix = act.ac_mix(t, ids)
    compiled = bool(t.compile)
    by_kind = {k: block_saved_bytes(act, k, d, e, t, tp, sp, residual32, compiled) for k in mix}
    if cp > 1 and fused_optimizer(cfg.hardware) and "none" in by_kind and not spec.ulysses_blocks:
        # GPU context parallel: K/V heads are repeated to the query heads before torch's ring SDPA, which
        # then keeps the repeated copies for backward instead of the grouped ones (not for the families
        # whose blocks run Ulysses only: its grouped SDPA).
        by_kind["none"] += e * 2 * (d.qw - d.k) / tp
    if cp > 1 and s.cp_style == CpStyle.ulysses and "none" in by_kind and not spec.ulysses_blocks:
        # Ulysses: the attention's output comes back from the exchange as a tensor of its own, which wo keeps
        # beside SDPA's saved output on the head shards (without CP wo's input is a view of that output). The
        # hybrids (ulysses_blocks) count it in their own terms, for their full-attention blocks only.
        by_kind["none"] += e * d.qw / tp
    lora = str(cfg.peft.method) != "none"
    if lora and sp and "selective" in by_kind and LORA_SELECTIVE_COUNTED_WITHOUT_SP:
        # Fine-tuning: selective AC keeps as much per block with sequence parallel as without it
        # (measured, real 2-rank gloo runs, planner7m LoRA TP(2) bf16: 4,619 bytes per token and block
        # either way, the no-SP count plus the adapters' autocast casts, which go with the autocast
        # region): count it without SP (13 % under the measured peak with the SP count).
        by_kind["selective"] = block_saved_bytes(act, "selective", d, e, t, tp, False, residual32, compiled)
    elif fsdp and sp and "selective" in by_kind:
        # Selective AC under sequence parallel keeps gathered hidden states the op-level count does not
        # explain (FSDP_SP_SELECTIVE_HIDDEN_STATES).
        by_kind["selective"] += FSDP_SP_SELECTIVE_HIDDEN_STATES * e * d.h
    elif sp and "selective" in by_kind and not lora:
        by_kind["selective"] += (TP_SP_SELECTIVE_GATHERED_HIDDEN_STATES + 1 / tp) * e * d.h
    # Fine-tuning: only the adapters train; QLoRA's base is NF4; the adapters join selective AC's matmul
    # alternation (dtlaunch.plan.peft).
    shard = layout.shard if fsdp or zero == 1 else 1
    ft = peft_terms(
        cfg,
        layers,
        tp,
        sp,
        shard if fsdp else 1,
        e,
        residual32,
        getattr(d, "routed_scale", 1.0),
        layout.ep,
        rank_tokens=int(t.micro_batch) * int(t.seq_len) * dec.rows_per_sample / cp,
    )
    if ft and "selective" in by_kind and t.ac_policy == "op":
        by_kind["selective"] += ft.selective
    if tiled(act, dec.mlp_tiles) and "none" in by_kind:
        by_kind["none"] -= mlp_saved_bytes(act, d, e, tp, compiled)  # the tiled MLP saves nothing of its own
    per_rank_stages = int(s.pp_stages_per_rank) if pp > 1 else 1
    shape = StageShape(
        cfg=cfg,
        decisions=dec,
        model=m,
        training=t,
        activation_model=act,
        block_dims=d,
        stage=stage,
        layers=layers,
        first_stage=first,
        last_stage=last,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=layout.ep,
        sequence_parallel=sp,
        compute_bytes=e,
        reduce_bytes=DTYPE_BYTES[cfg.precision.reduce_dtype],
        zero_stage=zero,
        ddp=zero in (0, 1) and layout.dp * cp > 1,
        shard_ranks=shard,
        rank_params=p_rank,
        block_params=blk,
        root_params=root,
        gathered_params=p_rank - not_gathered,
        gathered_block_params=blk - not_gathered // max(layers, 1),
        pp_microbatches=n_mb,
        # This rank's tokens: CP splits each sequence; a preference sample is two rows (dtlaunch.plan.objective).
        tokens=dec.rows_per_sample * (t.micro_batch // n_mb) * t.seq_len // cp,
        ac_mix=mix,
        blocks_without_ac=mix.get("none", 0),
        compiled=compiled,
        block_norm_params=spec.block_norm_params(m),
        tied_head=spec.head_params(m) == 0,
        microbatches_in_flight=in_flight(s.pp_schedule, pp, stage % pp, n_mb, per_rank_stages),
        block_saved_per_token=by_kind,
        peft=ft,
        scalar_head=reward,
    )
    return dataclasses.replace(shape, optim=optim_terms(shape, fused_optimizer(cfg.hardware)))


def loss_saved_per_token(c: StageShape) -> float:
    """The last stage's final norm and logits, saved for the loss backward (per token)."""
    if not c.last_stage:
        return 0.0
    final_norm = (
        c.peft.final_norm
        if c.peft
        else c.activation_model.final_norm_bytes(
            c.block_dims, c.compute_bytes, c.tp, c.sequence_parallel, c.fp32_residual
        )
    )
    return final_norm + logits_saved_per_token(c)


def blocks_saved_per_token(c: StageShape) -> float:
    """Saved bytes per token of the stage's blocks; under fine-tuning the frozen base keeps less (frozen
    norm gains; the first block's input needs no gradient), the adapters' own are a line of their own."""
    per_token = sum(n * c.block_saved_per_token[k] for k, n in c.ac_mix.items())
    if c.peft:
        per_token += c.blocks_without_ac * c.peft.act_block + (
            c.peft.act_first if c.first_stage and c.blocks_without_ac else 0.0
        )
    return per_token


def mean_block_saved_per_token(c: StageShape) -> float:
    """Saved bytes per token of the stage's mean block."""
    return blocks_saved_per_token(c) / c.layers if c.layers else 0.0
