"""One pipeline stage's analytic memory plan (the most loaded rank of the stage), in four phases.

Each phase is a function of the stage's shape (dtlaunch.plan.shape.StageShape: degrees, dtype sizes,
parameter and token counts) returning byte counts by line (dtlaunch.plan.lines.Line):
  `static_lines`    what the rank holds for the whole step: fp32 parameters (FSDP2 keeps fp32 shards, DDP
                    fp32 replicas), AdamW state, DDP buckets, accumulated gradients, autocast weight copies,
                    unsharded FSDP parameters (ZeRO-2 holds all of the stage's from forward to the end of
                    backward; ZeRO-3 the root unit), float8 casts, RoPE tables;
  `forward_lines`   saved activations (activations.py) times micro-batches in flight under the pipeline
                    schedule, logits/loss buffers (last stage only), all-to-all buffers;
  `backward_peak`   the largest of the backward moments (dtlaunch.plan.backward: the loss backward; inside
                    the first and the last block's backward; a later pipeline micro-batch's backward);
  `optimizer_lines` at the optimizer step: gradients complete, activations and unsharded buffers gone,
                    and on CPU the foreach-AdamW temporary (GPU runs step with the fused kernel).
`plan_stage` adds them up; the peak is the largest phase. Planned vs measured: tests/unit/test_plan_stage.py
(each phase against the memory tracker's categories) and bench/planner_accuracy.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dtlaunch.config.decisions import fused_optimizer
from dtlaunch.config.layout import Layout, pp_stage_layers
from dtlaunch.models.registry import model_spec
from dtlaunch.plan import autocast_casts, offload
from dtlaunch.plan.backward import backward_peak
from dtlaunch.plan.experts import all_to_all_bytes
from dtlaunch.plan.generation import PHASE_GENERATION, generation_lines, generation_phases, tool_process_bytes
from dtlaunch.plan.hardware import GLOO_EXTRA_BUFFER_COPIES, gloo_collectives
from dtlaunch.plan.lines import Line
from dtlaunch.plan.objective import reference_phases, reference_static_lines
from dtlaunch.plan.peft import gathered_block, param_lines
from dtlaunch.plan.shape import StageShape, blocks_saved_per_token, loss_saved_per_token, stage_shape

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Lines that do not exist at the optimizer step (freed after backward).
_GONE_AT_OPTIMIZER = (
    Line.ACTIVATIONS,
    Line.UNSHARDED_PARAMETERS,
    Line.AUTOCAST_WEIGHT_COPIES,
    Line.ACCUMULATED_GRADIENTS,
    Line.ROPE_COMPUTE_DTYPE,
    Line.ALL_TO_ALL_BUFFERS,
    Line.ROPE_CP_POSITIONS,
    Line.FLOAT8_CASTS,
    Line.LORA_ACTIVATIONS,
)

# A frozen embedding's own FSDP2 unit at its all-gather: the flat all-gather output and the unsharded
# storage it is copied into (real gloo runs, tiny model, 32k vocabulary, LoRA ZeRO-3: 3 x the embedding
# with gloo's extra copy).
# Not measured by a test: no tested layout has this moment as its peak (bench/planner_accuracy.py --real).
FROZEN_EMBEDDING_GATHER_COPIES = 2


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


def static_lines(c: StageShape) -> dict[str, float]:
    """What the rank holds through the whole step (before any activation)."""
    t, d, e, tp = c.training, c.block_dims, c.compute_bytes, c.tp
    lines: dict[str, float] = {}
    lines[Line.PARAMETERS] = 4 * c.rank_params / (c.shard_ranks if c.fsdp else 1)
    if c.peft:
        # A reward model's LM head is gone; its score head trains (fp32, with the norms).
        head = model_spec(c.model).head_params(c.model) // tp if c.last_stage and not c.scalar_head else 0
        embedding = c.vocab_params if c.first_stage and not c.tied_head else 0  # stored in the compute dtype too
        frozen = c.layers * (c.block_params - c.block_norm_params) + head + embedding
        lines.update(
            param_lines(
                c.peft, c.rank_params, frozen, c.layers, c.shard_ranks if c.fsdp else 1, e, c.grad_element_bytes
            )
        )
    rope_table = int(t.seq_len) * d.rope_columns  # the runtime builds RoPE for training.seq_len positions
    lines[Line.BUFFERS] = 2 * 4 * rope_table  # RoPE cos/sin, fp32
    if c.cp > 1:
        # The tables picked at this rank's token positions (Decoder.forward), shared by every block.
        lines[Line.ROPE_CP_POSITIONS] = 2 * (e if c.fsdp else 4) * (t.seq_len // c.cp) * d.rope_columns
    if c.fsdp and e != 4:
        # The hidden state is in the compute dtype, so the model casts both tables to it once per forward
        # (llama.Llama.forward); every block shares that copy until backward is done.
        lines[Line.ROPE_COMPUTE_DTYPE] = 2 * e * rope_table
    lines[Line.OPTIMIZER_STATE] = c.optim.state if c.optim else 8 * c.trained_params / c.shard_ranks
    lines.update(reference_static_lines(c))  # DPO's frozen reference copy
    if c.ddp:
        # DDP (gradient_as_bucket_view off) keeps flat fp32 buckets for the whole run; gradients are
        # separate tensors, allocated in backward and set to None after the step.
        lines[Line.DDP_BUCKETS] = 4 * c.trained_params
    if c.accum_steps > 1:
        # Between accumulation micro-steps the gradients stay allocated: DDP's full .grad; FSDP
        # reduce-scatters every micro-step (dtlaunch.train.step.grad_sync) and keeps only shards.
        lines[Line.ACCUMULATED_GRADIENTS] = c.gradient_bytes
    copies = autocast_casts.weight_copies(c)
    if copies is not None:
        lines[Line.AUTOCAST_WEIGHT_COPIES] = copies
    if c.fsdp and c.zero_stage == 2:
        lines[Line.UNSHARDED_PARAMETERS] = e * c.gathered_params if (c.shard_ranks > 1 or e != 4) else 0.0
        if c.peft:
            lines[Line.UNSHARDED_PARAMETERS] += (
                c.layers * (gathered_block(c.peft, c.block_params, e) - e * c.block_params) - e * c.frozen_end_params
            )
        if c.trained_head_unit:
            lines[Line.UNSHARDED_PARAMETERS] -= e * c.vocab_params  # resharded after the loss, unlike the root unit
    elif c.fsdp:
        # The root unit is not resharded after forward; measured (real gloo runs, MemTracker): its
        # head and final norm stay gathered until backward, the embedding's gathered copy does not add.
        # A frozen embedding and head, and a trained head under the chunked loss, are units of their own,
        # resharded after use.
        ends = c.vocab_params if c.head_unit else 0
        lines[Line.UNSHARDED_PARAMETERS] = e * (c.root_params - (c.vocab_params if c.first_stage else 0) - ends)
    if c.cfg.precision.float8 != "none":
        # One linear at a time holds float8 (1-byte) copies of its input and weight and their transposes,
        # bounded by the widest (F-wide) linear and split by TP like the linear itself (the autocast copies
        # Float8Linear does without: dtlaunch.plan.autocast_casts).
        lines[Line.FLOAT8_CASTS] = 2 * (c.tokens + d.h) * d.f / tp
    return lines


def forward_lines(c: StageShape) -> dict[str, float]:
    """What forward adds: saved activations of every micro-batch in flight, all-to-all buffers (EP)."""
    t = c.training
    per_token = blocks_saved_per_token(c)
    if c.first_stage:
        per_token += c.activation_model.embedding_bytes(c.block_dims, c.compute_bytes)
    per_token += loss_saved_per_token(c)
    # Under autocast the hidden state stays fp32 and each block's RoPE casts its own table slices.
    rope = (
        c.activation_model.rope_cast_bytes(c.block_dims, c.compute_bytes, int(t.seq_len) // c.cp) * c.blocks_without_ac
        if c.fp32_residual and not c.compiled
        else 0.0
    )
    lines = {
        Line.ACTIVATIONS: (per_token * c.tokens + rope * (t.micro_batch // c.pp_microbatches) / t.micro_batch)
        * c.microbatches_in_flight
    }
    if c.peft:
        lines[Line.LORA_ACTIVATIONS] = c.blocks_without_ac * c.peft.adapter_act * c.tokens * c.microbatches_in_flight
    a2a = all_to_all_bytes(c.cfg, c.ep, c.tokens, c.compute_bytes)
    if a2a:
        lines[Line.ALL_TO_ALL_BUFFERS] = a2a
    return lines


def _embedding_gather_moment(c: StageShape, lines: dict[str, float]) -> float:
    """FSDP2's all-gather of a frozen embedding's own unit (LoRA / QLoRA) at the start of forward: the flat
    all-gather output and the unsharded storage it is copied into exist together, next to the root's
    gathered head; gloo's all-gather (a CPU profile) holds one more full-size copy, NCCL does not.
    Measured (real gloo runs, tiny model, 32k vocabulary, LoRA ZeRO-3): 3 x the embedding. With the
    chunked loss, which no longer holds a chunk's logits in backward, this can be the step's peak."""
    if not (c.fsdp and c.peft and c.first_stage and c.vocab_params) or c.tied_head:
        return 0.0
    static = sum(lines.values()) - lines.get(Line.ACTIVATIONS, 0.0)
    gloo = gloo_collectives(c.cfg.hardware)
    copies = FROZEN_EMBEDDING_GATHER_COPIES + (GLOO_EXTRA_BUFFER_COPIES if gloo else 0)
    return static + copies * c.compute_bytes * c.vocab_params


def optimizer_lines(c: StageShape, lines: dict[str, float]) -> dict[str, float]:
    """At the optimizer step: activations and unsharded buffers are gone; gradients are complete, and
    foreach AdamW (CPU) allocates one temporary the size of the local fp32 state."""
    out = {k: v for k, v in lines.items() if k not in _GONE_AT_OPTIMIZER}
    if c.optim and c.optim.in_backward:
        return out  # every update ran inside backward; no gradient is left
    out[Line.GRADIENTS] = c.gradient_bytes
    temp = (
        c.optim.temp if c.optim else (0.0 if fused_optimizer(c.cfg.hardware) else 4 * c.trained_params / c.shard_ranks)
    )
    if temp:
        out[Line.OPTIMIZER_TEMPORARIES] = temp
    return out


def plan_stage(
    cfg: JobConfig,
    layout: Layout,
    stage: int,
    layers: int,
    first: bool,
    last: bool,
    layer_ids: list[int] | None = None,
    rollout_gather: str = "whole",
) -> StagePlan:
    """The stage's plan: its lines at the peak phase, and every phase's total (`rollout_gather`: how GRPO's rollout
    holds FSDP weights, dtlaunch.config.decisions.Decisions.generation_gather)."""
    c = stage_shape(cfg, layout, stage, layers, first, last, layer_ids)
    static = static_lines(c)
    # Offloading (dtlaunch.plan.offload): the device lines shrink by exactly what the host lines hold.
    lines, host = offload.split(c, {**static, **forward_lines(c)})
    at_step, host_at_step = offload.split_at_step(c, optimizer_lines(c, lines))
    phases = {"forward": sum(lines.values()), "backward": backward_peak(c, lines), "optimizer": sum(at_step.values())}
    gather = _embedding_gather_moment(c, lines)
    phases["forward"] = max(phases["forward"], gather)
    phases.update(reference_phases(c, static))  # DPO: the reference forward, or the precompute pass
    phases.update(generation_phases(c, static, rollout_gather))  # GRPO: the rollout's generation and old-policy pass
    phase = max(phases, key=lambda k: phases[k])
    if phase == "forward" and gather == phases["forward"]:
        lines = {k: v for k, v in lines.items() if k != Line.ACTIVATIONS}
        lines[Line.ALL_GATHER_BUFFERS] = gather - sum(lines.values())
    if phase == "backward":
        lines[Line.LOSS_BACKWARD_BUFFERS] = phases["backward"] - phases["forward"]
    if phase == "optimizer":
        lines = at_step
    if phase == PHASE_GENERATION:
        lines = generation_lines(c, static, rollout_gather)
    elif phase not in ("forward", "backward", "optimizer"):
        lines = {**static, Line.REFERENCE_FORWARD_BUFFERS: phases[phase] - sum(static.values())}
    return StagePlan(
        stage=stage,
        layers=layers,
        params=c.rank_params,
        lines=lines,
        phases=phases,
        phase=phase,
        peak=phases[phase],
        host=_with_tool_process(cfg, offload.host_peak_lines(host, host_at_step)),
    )


def _with_tool_process(cfg: JobConfig, host: dict[str, float]) -> dict[str, float]:
    """The rank's host lines and, under objective=grpo with user code, its tool process (held all along)."""
    tool = tool_process_bytes(cfg)
    return {**host, Line.TOOL_PROCESS_HOST: tool} if tool else host


def _likely_worst(split: list[int], pp: int) -> set[int]:
    """Ranks that can hold the peak: the first (embedding, most in flight), the second (in flight),
    the last (logits) and the one with the most layers."""
    most = max(range(pp), key=lambda r: (split[r] * (pp - r), -r))
    return {0, min(1, pp - 1), pp - 1, most}


def plan_stages(
    cfg: JobConfig, layout: Layout, all_stages: bool = True, rollout_gather: str = "whole", first_only: bool = False
) -> list[StagePlan]:
    """Every pipeline rank's plan (or, for the search, only those that can hold the peak; `first_only`: the
    first rank's alone, where a rank that does not fit is all the search needs to know)."""
    s = cfg.strategy
    per_rank = int(s.pp_stages_per_rank) if layout.pp > 1 else 1
    n_stages = layout.pp * per_rank
    split = pp_stage_layers(cfg.model.n_layers, n_stages, list(s.pp_layers_per_stage) or None)
    ranks = range(layout.pp) if all_stages or per_rank > 1 else sorted(_likely_worst(split, layout.pp))
    ranks = ranks[:1] if first_only else ranks
    starts = list(itertools.accumulate(split, initial=0))  # each stage's first global block index
    stages = []
    for rank in ranks:
        # A rank owns stages rank, rank + pp, ... (interleaved); add its chunks up as one rank.
        owned = list(range(rank, n_stages, layout.pp))
        layers = sum(split[i] for i in owned)
        ids = [b for i in owned for b in range(starts[i], starts[i + 1])]  # global block indices
        stages.append(
            plan_stage(
                cfg,
                layout,
                rank,
                layers,
                first=0 in owned,
                last=n_stages - 1 in owned,
                layer_ids=ids,
                rollout_gather=rollout_gather,
            )
        )
    return stages
