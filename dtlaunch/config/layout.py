"""Mesh arithmetic in one place: degrees, world size, batch accounting, pipeline stage split.

Pure Python (no torch) so the planner, the validators and the workers all agree on the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


def nproc_per_node(cfg: JobConfig, detected_gpus: int | None = None) -> int:
    """Workers per node: the configured number, else one per GPU, else 2 on a CPU host."""
    if cfg.launch.nproc_per_node > 0:
        return int(cfg.launch.nproc_per_node)
    if detected_gpus:
        return detected_gpus
    if cfg.hardware.gpus_per_node > 0:
        return int(cfg.hardware.gpus_per_node)
    return 2


def world_size(cfg: JobConfig, detected_gpus: int | None = None) -> int:
    # A scheduler's node count (Slurm, Kubernetes, SkyPilot) says how many nodes the job gets.
    nodes = cfg.cluster.nodes if cfg.cluster.kind != "local" else cfg.launch.nnodes
    return int(nodes) * nproc_per_node(cfg, detected_gpus)


@dataclass(frozen=True)
class Layout:
    """Resolved parallel degrees; dp_replicate * dp_shard * cp * tp * pp == world. `ep` takes no ranks of
    its own: it splits dp_shard into dp_shard / ep (FSDP of routed experts) x ep (expert parallel)."""

    world: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    # Context parallel: ranks that share each sample's sequence. They see the same samples (not part of
    # `dp`), but hold parameter shards and average gradients like data-parallel ranks.
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks one FSDP / ZeRO shard group spans: dp_shard x cp (context-parallel peers hold the same
        parameters, so they share the shards, as torchtitan does)."""
        return self.dp_shard * self.cp

    @classmethod
    def resolve(cls, strategy: Any, world: int) -> Layout:
        """Fill the one `-1` degree with the rest of the world; check the product."""
        degrees = {d: int(getattr(strategy, d, 1)) for d in DIMS}
        bad = [d for d, v in degrees.items() if v == 0 or v < -1]
        if bad:
            d = bad[0]
            raise ConfigError(f"strategy.{d}={degrees[d]} is not a degree: use a positive integer or -1 (the rest)")
        free = [d for d, v in degrees.items() if v == -1]
        if len(free) > 1:
            raise ConfigError(
                f"strategy.{free[0]} and strategy.{free[1]} are both -1: only one degree can take 'the rest'; "
                f"set strategy.{free[1]}=<n>"
            )
        fixed = 1
        for v in degrees.values():
            if v != -1:
                fixed *= v
        if free:
            if world % fixed:
                raise ConfigError(
                    f"strategy.{free[0]}=-1 cannot fill the world of {world} ranks: the other degrees multiply to "
                    f"{fixed}, which does not divide {world}; change the degrees or launch.nproc_per_node"
                )
            degrees[free[0]] = world // fixed
        elif fixed != world:
            desc = " x ".join(f"strategy.{d}={v}" for d, v in degrees.items())
            raise ConfigError(
                f"layout {desc} = {fixed} ranks but the world has {world}: set one degree to -1 "
                f"or change launch.nproc_per_node/launch.nnodes"
            )
        return cls(world=world, **degrees, ep=int(getattr(strategy, "ep", 1)))


def expert_fsdp_degree(layout: Layout) -> int:
    """Shard ranks left to FSDP over routed experts once `ep` of them hold different experts."""
    return layout.dp_shard // layout.ep


def shards_with_fsdp(cfg: JobConfig, layout: Layout) -> bool:
    """Whether the runtime wraps the model in FSDP2 (ZeRO-2/3). Over one data-parallel rank there is
    nothing to shard, except under strategy.cpu_offload: FSDP over a 1-rank mesh is what keeps the
    parameters, gradients and optimizer state on the host (ZeRO-Offload on one GPU)."""
    if int(cfg.strategy.zero_stage) < 2:
        return False
    return layout.dp * layout.cp > 1 or bool(cfg.strategy.cpu_offload)


# training.loss_chunks=0 (auto): chunk where one rank's micro-batch logits hold at least this many elements
# (64 MiB in fp32; a 128k vocabulary reaches it at 128 tokens, a 32k one at 512), into this many chunks.
AUTO_CHUNK_MIN_LOGITS = 16 * 2**20
AUTO_CHUNKS = 8


def loss_chunks(cfg: JobConfig) -> int:
    """Token chunks the output head and its loss run over (training.loss_chunks): the next-token loss, and
    the preference objectives' per-token log-probs (the policy's and the reference's). One for objective=reward:
    its scalar head has no vocabulary to chunk (dtlaunch.train.objectives.reward). The planner and the
    runtime both ask here, so `auto` (0) is decided once: from the model's vocabulary and one rank's
    micro-batch rows x sequence (before context parallel splits it: an upper bound)."""
    if str(cfg.objective.name) == "reward":
        return 1
    chunks = int(cfg.training.loss_chunks)
    if chunks:
        return chunks
    t = cfg.training
    logits = int(t.micro_batch) * rows_per_sample(cfg) * int(t.seq_len) * int(cfg.model.vocab_size)
    return AUTO_CHUNKS if logits >= AUTO_CHUNK_MIN_LOGITS else 1


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


def keeps_old_logps(cfg: JobConfig) -> bool:
    """objective=grpo: whether a rollout runs the old policy's no-grad pass over its rows (their log-probs kept
    for the loss's ratio): with num_iterations > 1 (later steps train on weights that moved), and for the
    sampler correction (objective.importance_sampling_correction compares the sampler with them, as TRL).
    The planner's phase and time and the rollout both ask here."""
    o = cfg.objective
    return int(o.num_iterations) > 1 or bool(o.importance_sampling_correction)


def rows_per_sample(cfg: JobConfig) -> int:
    """2 for preference pairs (a chosen and a rejected row per sample), else 1 (a GRPO sample is one
    completion): the planner's tokens, the runtime's throughput and the MLP's tiles all count rows."""
    return 1 if str(cfg.objective.name) in ("sft", "grpo") else 2


def ulysses_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads (of one tensor-parallel rank) that Ulysses' all-to-all carries: all of them when cp divides
    them, each rank then receiving kv_heads / cp whole groups of query heads; otherwise (grouped-query
    attention with fewer K/V heads than CP ranks, e.g. 8 over cp=16) each K/V head repeated until the count
    is lcm(kv_heads, cp), so that every rank receives the K/V heads its query heads read. The runtime
    (train/parallel/ulysses.py) and the planner (plan/ulysses_terms.py) both take the count from here."""
    return kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)


# training.mlp_tiles=0: tiles of at most this many tokens (a micro-batch's rows x its local sequence).
MLP_TILE_TOKENS = 8192


def mlp_tiles(cfg: JobConfig, layout: Layout) -> int:
    """Sequence tiles each block's MLP runs over (training.mlp_tiles; 0 = ceil(tokens / MLP_TILE_TOKENS) of
    one rank's micro-batch, at most one per position). Sequence parallel hands the MLP a sequence-sharded
    DTensor, which the tiles do not split: untiled there (an explicit value is refused by validate)."""
    n = int(cfg.training.mlp_tiles)
    if n:
        return n
    if layout.tp > 1 and cfg.strategy.sequence_parallel:
        return 1
    rows = int(cfg.training.micro_batch) * rows_per_sample(cfg)
    seq = int(cfg.training.seq_len) // layout.cp
    return max(1, min(seq, -(-rows * seq // MLP_TILE_TOKENS)))


def decode_positions_multiple(cfg: JobConfig, tp: int) -> int:
    """objective=grpo's rollout: every forward carries a multiple of this many positions (sequence parallel
    shards each forward's positions over the TP ranks; dtlaunch.infer.batch_generate pads to it). The
    runtime passes it to the generator, the planner sizes the KV cache with it."""
    return tp if tp > 1 and cfg.strategy.sequence_parallel else 1


def generation_gather(cfg: JobConfig, layout: Layout) -> str:
    """How objective=grpo's rollout holds FSDP ZeRO-3 weights while it generates: "whole" or "unit"; "" where
    the choice does not arise (another objective, no ZeRO-3 sharding: the weights stay as they are). `auto`
    reads as "whole" here: the plan (dtlaunch.plan.memory.plan_memory) turns it into "unit" when only that
    fits, and the launcher writes that choice into the run's config.yaml, which the runtime reads."""
    if str(cfg.objective.name) != "grpo" or not shards_with_fsdp(cfg, layout) or int(cfg.strategy.zero_stage) != 3:
        return ""
    mode = str(cfg.objective.generation_gather)
    return "whole" if mode == "auto" else mode


def activation_offload(cfg: JobConfig, pp: int) -> bool:
    """training.activation_offload as the job runs it (the planner, the layout search and the runtime ask
    here). true / false: as set. null, the default: on where it costs no step time by the plan's
    step-time model (plan.search.step_time hides host copies behind compute) and changes no numerics:
    under full activation checkpointing only each block's input moves (h values a token and block, against
    the block's ~24·h² FLOPs a token, computed and recomputed), on a GPU profile (hardware.gpus_per_node
    > 0) whose host RAM is known, without pipeline parallel (which the offload hooks do not support) and
    without strategy.cpu_offload (whose state copies already fill the host link beyond what compute hides,
    so the step-time model adds every activation copy to the step)."""
    t, hw = cfg.training, cfg.hardware
    if t.activation_offload is not None:
        return bool(t.activation_offload)
    full = str(t.activation_checkpointing) == "full"
    free = pp == 1 and not cfg.strategy.cpu_offload
    return full and free and int(hw.gpus_per_node) > 0 and float(hw.host_memory_gib) > 0


def offload_composes_with_compile(activation_checkpointing: Any) -> bool:
    """Whether `training.activation_offload` combines with `training.compile` under this checkpointing mode.

    Each block is compiled inside its checkpoint wrapper: the offload hooks and the checkpoint's saving of
    the block input stay eager around the compiled graph (Dynamo would otherwise trace the hooks into it),
    and the compiled block runs again for the recompute. That needs every block checkpointed whole:
    `full`. The rule (config.rules.offload), the layout search (plan.offload) and the runtime
    (train.parallel.parallelize) decide through this one function."""
    return str(activation_checkpointing) == "full"


def autocast_compute(cfg: JobConfig, layout: Layout) -> bool:
    """Low-precision compute by autocast (fp32 master weights, DDP or one process) rather than by FSDP's
    mixed-precision policy (train.parallel.parallelize.compute_context; the planner's `autocast`)."""
    return str(cfg.precision.param_dtype) != "fp32" and not shards_with_fsdp(cfg, layout)


def residual_in_compute_dtype(cfg: JobConfig, layout: Layout) -> bool:
    """precision.residual_dtype asks autocast's fp32 residual stream to be kept in the compute dtype instead:
    the runtime casts the embedding's output (the decoder's `residual_dtype`) and the planner counts the
    blocks' residual terms as the compute dtype's (as under FSDP's mixed precision)."""
    return autocast_compute(cfg, layout) and str(cfg.precision.residual_dtype) not in ("auto", "fp32")


def fp32_residual(cfg: JobConfig, layout: Layout) -> bool:
    """The residual stream is fp32 while the blocks compute in a lower precision (autocast, the default)."""
    return autocast_compute(cfg, layout) and not residual_in_compute_dtype(cfg, layout)


def grad_accum_steps(cfg: JobConfig, layout: Layout) -> int:
    """Micro-steps per optimizer step; global_batch = micro_batch * dp * accumulation."""
    gb = global_batch(cfg, layout)
    return gb // (cfg.training.micro_batch * layout.dp)


def global_batch(cfg: JobConfig, layout: Layout) -> int:
    return global_batch_size(cfg, layout.dp)


def global_batch_size(cfg: JobConfig, dp_size: int) -> int:
    """Samples per optimizer step: training.global_batch, or one micro-batch per data-parallel rank (0)."""
    gb = int(cfg.training.global_batch)
    return gb if gb > 0 else int(cfg.training.micro_batch) * dp_size


def pp_microbatches(cfg: JobConfig, layout: Layout) -> int:
    """Pipeline micro-batches per micro-step (0 in the config = one per pipeline rank)."""
    n = int(cfg.strategy.pp_microbatches)
    return n if n > 0 else layout.pp


def pp_stage_layers(n_layers: int, n_stages: int, explicit: list[int] | None = None) -> list[int]:
    """Transformer blocks per pipeline stage. Uneven splits give the extra blocks to the middle
    stages, because the first stage also holds the embedding and the last the output head."""
    if explicit:
        return list(explicit)
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    # Hand out the remainder from the middle outward so the end stages stay lighter.
    order = sorted(range(n_stages), key=lambda i: (abs(i - (n_stages - 1) / 2), i))
    for i in order[:extra]:
        counts[i] += 1
    return counts
