"""The decisions made from a job once: one frozen `Decisions`, computed by validation (job.validate) and by
the worker's runtime from the same resolved config, and read by the planner, the launcher and the worker.

Each field is decided here and nowhere else: a planner that sized one choice while the runtime ran another
would print a plan for a different job. Pure Python (no torch). Choices that vary within a job (per stage,
per module) stay functions of their inputs, below the class: `head_unit`, `offload_composes_with_compile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtlaunch.config.layout import Layout, world_size
from dtlaunch.config.schema import ObjectiveName

if TYPE_CHECKING:
    from dtlaunch.config.schema import HardwareConfig, JobConfig

# training.loss_chunks=0 (auto): chunk where one rank's micro-batch logits hold at least this many elements
# (64 MiB in fp32; a 128k vocabulary reaches it at 128 tokens, a 32k one at 512), into this many chunks.
AUTO_CHUNK_MIN_LOGITS = 16 * 2**20
AUTO_CHUNKS = 8
# training.mlp_tiles=0: tiles of at most this many tokens (a micro-batch's rows x its local sequence).
MLP_TILE_TOKENS = 8192


@dataclass(frozen=True)
class Decisions:
    layout: Layout
    # The runtime wraps the model in FSDP2 (ZeRO-2/3). Over one data-parallel rank there is nothing to
    # shard, except under strategy.cpu_offload: FSDP over a 1-rank mesh is what keeps the parameters,
    # gradients and optimizer state on the host (ZeRO-Offload on one GPU).
    fsdp: bool
    # Samples per optimizer step: training.global_batch, or one micro-batch per data-parallel rank (0).
    global_batch: int
    # Micro-steps per optimizer step: global_batch = micro_batch x dp x grad_accum.
    grad_accum: int
    # Pipeline micro-batches per micro-step (strategy.pp_microbatches; 0 = one per pipeline rank).
    pp_microbatches: int
    # 2 for preference pairs (a chosen and a rejected row per sample), else 1 (a GRPO sample is one
    # completion): the planner's tokens, the runtime's throughput and the MLP's tiles all count rows.
    rows_per_sample: int
    # Token chunks the output head and its loss run over (training.loss_chunks; see _loss_chunks).
    loss_chunks: int
    # Sequence tiles each block's MLP runs over (training.mlp_tiles; see _mlp_tiles).
    mlp_tiles: int
    # training.activation_offload as the job runs it (see _activation_offload).
    activation_offload: bool
    # Low-precision compute by autocast (fp32 master weights, DDP or one process) rather than by FSDP's
    # mixed-precision policy (train.parallel.parallelize.compute_context; the planner's `autocast`).
    autocast: bool
    # precision.residual_dtype keeps autocast's residual stream in the compute dtype instead of fp32: the
    # runtime casts the embedding's output and the planner counts the residual terms in that dtype.
    residual_in_compute_dtype: bool
    # The residual stream is fp32 while the blocks compute in a lower precision (autocast, the default).
    fp32_residual: bool
    # objective=grpo: a rollout runs the old policy's no-grad pass over its rows (their log-probs kept for the
    # loss's ratio): with num_iterations > 1 (later steps train on weights that moved), and for the sampler
    # correction (objective.importance_sampling_correction compares the sampler with them, as TRL).
    keeps_old_logps: bool
    # objective=grpo's rollout: every forward carries a multiple of this many positions (sequence parallel
    # shards each forward's positions over the TP ranks; infer.batch_generate pads to it, the plan sizes
    # the KV cache with it).
    decode_positions_multiple: int
    # How objective=grpo's rollout holds FSDP ZeRO-3 weights while it generates (see _generation_gather).
    generation_gather: str

    @classmethod
    def of(cls, cfg: JobConfig, layout: Layout | None = None) -> Decisions:
        """The job's decisions on `layout` (default: its strategy resolved on the configured world)."""
        layout = layout if layout is not None else Layout.resolve(cfg.strategy, world_size(cfg))
        t, grpo = cfg.training, cfg.objective.name == ObjectiveName.grpo
        rows = 1 if cfg.objective.name in (ObjectiveName.sft, ObjectiveName.grpo) else 2
        fsdp = int(cfg.strategy.zero_stage) >= 2 and (layout.dp * layout.cp > 1 or bool(cfg.strategy.cpu_offload))
        autocast = str(cfg.precision.param_dtype) != "fp32" and not fsdp
        residual_low = autocast and str(cfg.precision.residual_dtype) not in ("auto", "fp32")
        gb = global_batch_size(cfg, layout.dp)
        n_mb = int(cfg.strategy.pp_microbatches)
        return cls(
            layout=layout,
            fsdp=fsdp,
            global_batch=gb,
            grad_accum=gb // (int(t.micro_batch) * layout.dp),
            pp_microbatches=n_mb if n_mb > 0 else layout.pp,
            rows_per_sample=rows,
            loss_chunks=_loss_chunks(cfg, rows),
            mlp_tiles=_mlp_tiles(cfg, layout, rows),
            activation_offload=_activation_offload(cfg, layout.pp),
            autocast=autocast,
            residual_in_compute_dtype=residual_low,
            fp32_residual=autocast and not residual_low,
            keeps_old_logps=grpo
            and (int(cfg.objective.num_iterations) > 1 or bool(cfg.objective.importance_sampling_correction)),
            decode_positions_multiple=layout.tp if layout.tp > 1 and cfg.strategy.sequence_parallel else 1,
            generation_gather=_generation_gather(cfg, fsdp) if grpo else "",
        )


def global_batch_size(cfg: JobConfig, dp: int) -> int:
    """Samples per optimizer step over `dp` data-parallel ranks: training.global_batch, or one micro-batch
    per rank (0). Also read by the loaders (train.data), which know their data-parallel size from the mesh."""
    gb = int(cfg.training.global_batch)
    return gb if gb > 0 else int(cfg.training.micro_batch) * dp


def _loss_chunks(cfg: JobConfig, rows: int) -> int:
    """The next-token loss's, and the preference objectives' per-token log-probs' (the policy's and the
    reference's), chunks. One for objective=reward: its scalar head has no vocabulary to chunk
    (dtlaunch.train.objectives.reward). `auto` (0): from the model's vocabulary and one rank's micro-batch
    rows x sequence (before context parallel splits it: an upper bound)."""
    if cfg.objective.name == ObjectiveName.reward:
        return 1
    t = cfg.training
    if int(t.loss_chunks):
        return int(t.loss_chunks)
    logits = int(t.micro_batch) * rows * int(t.seq_len) * int(cfg.model.vocab_size)
    return AUTO_CHUNKS if logits >= AUTO_CHUNK_MIN_LOGITS else 1


def _mlp_tiles(cfg: JobConfig, layout: Layout, rows: int) -> int:
    """training.mlp_tiles; 0 = ceil(tokens / MLP_TILE_TOKENS) of one rank's micro-batch, at most one per
    position. Sequence parallel hands the MLP a sequence-sharded DTensor, which the tiles do not split:
    untiled there (an explicit value is refused by validate)."""
    n = int(cfg.training.mlp_tiles)
    if n:
        return n
    if layout.tp > 1 and cfg.strategy.sequence_parallel:
        return 1
    seq = int(cfg.training.seq_len) // layout.cp
    return max(1, min(seq, -(-int(cfg.training.micro_batch) * rows * seq // MLP_TILE_TOKENS)))


def _activation_offload(cfg: JobConfig, pp: int) -> bool:
    """true / false: as set. null, the default: on where it costs no step time by the plan's step-time model
    (plan.search.step_time hides host copies behind compute) and changes no numerics: under full activation
    checkpointing only each block's input moves (h values a token and block, against the block's ~24·h²
    FLOPs a token, computed and recomputed), on a GPU profile (hardware.gpus_per_node > 0) whose host RAM is
    known, without pipeline parallel (which the offload hooks do not support) and without
    strategy.cpu_offload (whose state copies already fill the host link beyond what compute hides, so the
    step-time model adds every activation copy to the step)."""
    t, hw = cfg.training, cfg.hardware
    if t.activation_offload is not None:
        return bool(t.activation_offload)
    full = str(t.activation_checkpointing) == "full"
    free = pp == 1 and not cfg.strategy.cpu_offload
    return full and free and int(hw.gpus_per_node) > 0 and float(hw.host_memory_gib) > 0


def _generation_gather(cfg: JobConfig, fsdp: bool) -> str:
    """ "whole" or "unit"; "" where the choice does not arise (no ZeRO-3 sharding: the weights stay as they
    are). `auto` reads as "whole" here: the plan (dtlaunch.plan.memory.plan_memory) turns it into "unit" when
    only that fits, and the launcher writes that choice into the run's config.yaml, which the runtime reads."""
    if not fsdp or int(cfg.strategy.zero_stage) != 3:
        return ""
    mode = str(cfg.objective.generation_gather)
    return "whole" if mode == "auto" else mode


def head_unit(head_trains: bool, tied: bool, owns_head: bool, loss_chunks: int, tp: int) -> bool:
    """Under FSDP2, whether a stage's output head is a unit of its own, gathered only while it runs (its
    forward, or the chunked loss run as its forward): the one decision the planner (plan/shape.py) and the
    runtime (train/parallel/head_unit.py) both take. A head tied to the embedding stays in the root with it.
    A frozen head (LoRA / QLoRA, DPO's reference copy) is one, except with a chunked loss under tensor
    parallel: the styles' hooks on its forward would treat the loss as logits, so the loss reads the head
    from the root. A trained head is one only under the chunked loss without tensor parallel (a full-
    vocabulary pass keeps its logits until backward anyway)."""
    if tied or not owns_head:
        return False
    if head_trains:
        return loss_chunks > 1 and tp == 1
    return loss_chunks == 1 or tp == 1


def offload_composes_with_compile(activation_checkpointing: Any) -> bool:
    """Whether `training.activation_offload` combines with `training.compile` under this checkpointing mode.

    Each block is compiled inside its checkpoint wrapper: the offload hooks and the checkpoint's saving of
    the block input stay eager around the compiled graph (Dynamo would otherwise trace the hooks into it),
    and the compiled block runs again for the recompute. That needs every block checkpointed whole:
    `full`. The rule (job.rules.offload), the layout search (plan.offload) and the runtime
    (train.parallel.parallelize) decide through this one function."""
    return str(activation_checkpointing) == "full"


def fused_optimizer(hw: HardwareConfig) -> bool:
    """Whether a run on this profile steps AdamW with the fused kernel: GPU profiles do (the runtime picks
    fused on CUDA, dtlaunch.train.optim), the CPU profile runs foreach, which allocates temporaries."""
    return int(hw.gpus_per_node) > 0
