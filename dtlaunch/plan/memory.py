"""The analytic per-rank memory model (pure Python, never imports torch).

For every pipeline stage (the most loaded rank of each stage) it adds up, in bytes of tensors the
runtime allocates:
  parameters (fp32 — FSDP2 keeps fp32 shards, DDP fp32 replicas), gradients, AdamW state,
  unsharded FSDP parameters in compute dtype (ZeRO-2 holds all of the stage's from forward to the
  end of backward; ZeRO-3 about two blocks in flight), unsharded gradients before reduce-scatter,
  saved activations (activations.py) times micro-batches in flight under the pipeline schedule,
  logits/loss buffers (last stage only) and the foreach-AdamW temporary at the optimizer step,
and evaluates three phases: end of forward, start of backward (saved activations + loss gradients)
and optimizer step (gradients + state + temporary, from step 2 on when Adam state exists).
The peak is the largest phase. Device overheads (CUDA context, communicator buffers, allocator
fragmentation) come from the hardware profile and are reported as separate lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtlaunch.config.layout import Layout, grad_accum_steps, pp_microbatches, pp_stage_layers
from dtlaunch.models.shapes import block_params
from dtlaunch.plan import activations as act

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


def _stage_params(m: Any, layers: int, first: bool, last: bool, tp: int) -> tuple[int, int]:
    """(params on one TP rank of the stage, largest FSDP unit in params). Matrices divide by tp,
    norm weights are replicated."""
    h, v = m.dim, m.vocab_size
    blk_norms = 2 * h
    blk = (block_params(m) - blk_norms) // tp + blk_norms
    p = layers * blk
    root = 0
    if first:
        root += v * h // tp
    if last:
        root += v * h // tp + h
    return p + root, max(blk, root)


def plan_stage(cfg: Any, layout: Layout, stage: int, layers: int, first: bool, last: bool) -> StagePlan:
    m, s, t = cfg.model, cfg.strategy, cfg.training
    d = act.BlockDims.of(m)
    tp, pp = layout.tp, layout.pp
    sp = bool(s.sequence_parallel) and tp > 1
    e = act.DTYPE_BYTES[cfg.precision.param_dtype]
    r = act.DTYPE_BYTES[cfg.precision.reduce_dtype]
    zero = int(s.zero_stage)
    fsdp = zero >= 2
    shard = layout.dp_shard if fsdp or zero == 1 else 1
    p_rank, unit = _stage_params(m, layers, first, last, tp)
    accum = grad_accum_steps(cfg, layout)
    n_mb = pp_microbatches(cfg, layout) if pp > 1 else 1
    tokens = (t.micro_batch // n_mb) * t.seq_len
    ac = t.activation_checkpointing

    lines: dict[str, float] = {}
    lines["parameters"] = 4 * p_rank / (shard if fsdp else 1)
    grads = 4 * p_rank / (shard if fsdp else 1)
    lines["optimizer state"] = 8 * p_rank / shard
    ddp = zero in (0, 1) and layout.dp > 1
    # DDP's gradients are views of its persistent buckets (gradient_as_bucket_view): always there.
    grads_in_forward = grads if (ddp or accum > 1) else 0.0
    if not fsdp and e != 4:
        # autocast keeps a compute-dtype copy of every weight from its use in forward to backward.
        lines["autocast weight copies"] = e * p_rank
    if fsdp:
        if zero == 2:
            lines["unsharded parameters"] = e * p_rank if (shard > 1 or e != 4) else 0.0
        else:
            lines["unsharded parameters"] = 2 * e * unit
    per_rank_stages = int(s.pp_stages_per_rank) if pp > 1 else 1
    held = in_flight(s.pp_schedule, pp, stage % pp, n_mb, per_rank_stages)
    per_token = layers * act.block_bytes(d, e, ac, tp, sp)
    if first:
        per_token += act.embedding_bytes(d, e)
    if last:
        per_token += act.final_norm_bytes(d, e, tp, sp) + act.logits_forward_bytes(d, e, tp)
    lines["activations"] = per_token * tokens * held
    recompute = act.recompute_bytes(d, e, ac, tp, sp) * tokens if layers else 0.0
    loss_bwd = act.logits_backward_bytes(d, e, tp) * tokens if last else 0.0

    base = sum(lines.values())
    unsharded_grads = r * unit if fsdp else 0.0
    phases = {
        "forward": base + grads_in_forward,
        # Start of backward: loss/logits gradients (last stage) or the largest block being
        # recomputed with its gradient buffers (AC), on top of everything forward kept.
        "backward": base + grads_in_forward + max(loss_bwd, recompute) + unsharded_grads,
        # Optimizer step: activations and unsharded buffers are gone; gradients are complete and
        # foreach AdamW allocates one temporary the size of the local fp32 state.
        "optimizer": lines["parameters"] + lines["optimizer state"] + grads + 4 * p_rank / shard,
    }
    phase = max(phases, key=lambda k: phases[k])
    lines["gradients"] = grads if phase == "optimizer" else grads_in_forward
    if phase == "backward":
        lines["loss/recompute buffers"] = max(loss_bwd, recompute)
        if unsharded_grads:
            lines["unsharded gradients"] = unsharded_grads
    if phase == "optimizer":
        for k in ("activations", "unsharded parameters", "autocast weight copies"):
            lines.pop(k, None)
        lines["optimizer temporaries"] = 4 * p_rank / shard
    return StagePlan(
        stage=stage, layers=layers, params=p_rank, lines=lines, phases=phases, phase=phase, peak=phases[phase]
    )


def _likely_worst(split: list[int], pp: int) -> set[int]:
    """Ranks that can hold the peak: the first (embedding, most in flight), the second (in flight),
    the last (logits) and the one with the most layers."""
    most = max(range(pp), key=lambda r: (split[r] * (pp - r), -r))
    return {0, min(1, pp - 1), pp - 1, most}


def plan_memory(cfg: Any, layout: Layout, all_stages: bool = True) -> MemoryPlan:
    """Plan every pipeline rank (or, for the search, only those that can hold the peak)."""
    s = cfg.strategy
    per_rank = int(s.pp_stages_per_rank) if layout.pp > 1 else 1
    n_stages = layout.pp * per_rank
    split = pp_stage_layers(cfg.model.n_layers, n_stages, list(s.pp_layers_per_stage) or None)
    stages = []
    ranks = range(layout.pp) if all_stages or per_rank > 1 else sorted(_likely_worst(split, layout.pp))
    for rank in ranks:
        # A rank owns stages rank, rank + pp, ... (interleaved); add its chunks up as one rank.
        owned = list(range(rank, n_stages, layout.pp))
        layers = sum(split[i] for i in owned)
        stages.append(plan_stage(cfg, layout, rank, layers, first=0 in owned, last=n_stages - 1 in owned))
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
    return MemoryPlan(
        recipe=str(cfg.recipe or "custom"),
        hardware=hw.name,
        capacity=hw.memory_gib * GIB,
        layout=lay,
        stages=stages,
        worst=worst,
        overheads=overheads,
    )
