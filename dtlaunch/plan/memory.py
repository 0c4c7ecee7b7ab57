"""The analytic per-rank memory plan of a job (pure Python, never imports torch).

Every pipeline rank (the most loaded rank of each stage) is planned by dtlaunch.plan.stage, in bytes of
tensors the runtime allocates, phase by phase; the job's peak is the most loaded rank's. Device overheads
(CUDA context, communicator buffers, allocator fragmentation) come from the hardware profile and are
reported as separate lines. A model without a closed-form memory model is planned by tracing one step
of the real runtime (dtlaunch.plan.trace).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.lines import Line
from dtlaunch.plan.offload import offload_notes, ranks_per_node
from dtlaunch.plan.peft import peft_notes
from dtlaunch.plan.stage import StagePlan, plan_stages
from dtlaunch.plan.trace import skip_reason, trace_peak, traced_with_fake_tensors, weights_lower_bound

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

GIB = 1024**3
PHASES = ("forward", "backward", "optimizer")


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
    host_ranks: int = 1  # ranks sharing one node's host RAM
    host_capacity: float = 0.0  # bytes of host RAM per node (hardware.host_memory_gib)
    generation_gather: str = (
        ""  # objective=grpo under ZeRO-3: "whole" or "unit" (config.decisions.Decisions.generation_gather)
    )
    # The plan's choice under training.loss_chunks=0 (auto) on a GPU profile: 1 where the full-vocabulary pass
    # fits (see plan_memory); 0 where it chose nothing (the job's own count, config.decisions).
    loss_chunks: int = 0
    # Why this host could not plan the job (a model without a closed-form plan whose trace cannot run here):
    # the peak is then a lower bound (this rank's share of the weights) and the plan never "fits".
    unplanned: str = ""

    @property
    def host_per_rank(self) -> float:
        """Offloaded bytes one rank keeps in host RAM at its host peak (0 without offloading)."""
        return max(s.host_peak for s in self.stages)

    @property
    def host_total(self) -> float:
        return self.host_per_rank * self.host_ranks

    @property
    def host_fits(self) -> bool:
        # Capacity 0 is unknown: offloading is refused then (config rules), and what is left on the host (a
        # GRPO rank's tool process) is shown, not checked.
        return self.host_total <= self.host_capacity or self.host_per_rank == 0 or self.host_capacity == 0

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
        return not self.unplanned and self.headroom >= 0 and self.host_fits

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
            "verdict": "unplanned" if self.unplanned else "fits" if self.fits else "does not fit",
            **({"unplanned": self.unplanned} if self.unplanned else {}),
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
            **({"generation_gather": self.generation_gather} if self.generation_gather else {}),
            **({"loss_chunks": self.loss_chunks} if self.loss_chunks else {}),
            "suggestions": list(self.suggestions),
            **(self._host_dict() if self.host_per_rank else {}),
        }

    def _host_dict(self) -> dict:
        return {
            "host": {
                "per_rank_bytes": int(self.host_per_rank),
                "ranks_per_node": self.host_ranks,
                "per_node_bytes": int(self.host_total),
                "capacity_bytes": int(self.host_capacity),
                "fits": self.host_fits,
                "categories": {k: int(v) for k, v in self.worst_host.items()},
            }
        }

    @property
    def worst_host(self) -> dict[str, float]:
        return max(self.stages, key=lambda s: s.host_peak).host


def plan_memory(cfg: JobConfig, layout: Layout, all_stages: bool = True, first_only: bool = False) -> MemoryPlan:
    """Plan every pipeline rank (or, for the search, only those that can hold the peak). objective=grpo
    under ZeRO-3 with objective.generation_gather=auto: the rollout gathers the whole model unless only one
    unit at a time fits; the plan says which (`generation_gather`, and a note). training.loss_chunks=0 (auto),
    where the job's own auto chunks the loss (config.decisions), on a GPU profile: the full-vocabulary pass where
    it fits, else the chunks; the plan says which (`loss_chunks`, and a note)."""
    dec = Decisions.of(cfg, layout)
    if _full_pass_left_to_plan(cfg, dec):
        full = plan_memory(_with_loss_chunks(cfg, 1), layout, all_stages, first_only)
        if full.fits:
            full.loss_chunks = 1
            full.notes.append(
                f"training.loss_chunks=auto: one full-vocabulary pass, which fits (its {dec.loss_chunks} chunks cost up to "
                f"9 % of a step on an H200); training.loss_chunks={dec.loss_chunks} chunks anyway"
            )
            return full
    gather = dec.generation_gather
    plan = _plan_memory(cfg, dec, all_stages, gather, first_only)
    if gather == "whole" and str(cfg.objective.generation_gather) == "auto" and not plan.fits:
        unit = _plan_memory(cfg, dec, all_stages, "unit", first_only)
        if unit.fits:
            unit.notes.append(
                "generation gathers the weights one FSDP unit at a time, again for every decode step: the whole "
                "model does not fit beside the KV cache (objective.generation_gather=unit)"
            )
            return unit
    return plan


def _full_pass_left_to_plan(cfg: JobConfig, dec: Decisions) -> bool:
    """Whether the plan picks the loss's chunks: training.loss_chunks=0 (auto) where the job's own auto would
    chunk, on a GPU profile. The chunks save memory at the price of one more head matmul per token; where the
    full pass fits that price buys nothing (plan --search prefers the full pass the same way,
    plan.search.loss_chunk_options). The CPU profile keeps the job's own count: its "device" is the host's
    RAM, shared with the loader and everything else on the machine, where a plan that just fits is no promise."""
    return int(cfg.training.loss_chunks) == 0 and dec.loss_chunks > 1 and int(cfg.hardware.gpus_per_node) > 0


def _with_loss_chunks(cfg: JobConfig, chunks: int) -> JobConfig:
    """`cfg` with training.loss_chunks=`chunks`, the job itself untouched (a schema dataclass, or the
    search's namespaces)."""
    job = copy.copy(cfg)
    job.training = copy.copy(cfg.training)
    job.training.loss_chunks = chunks
    return job


def _plan_memory(cfg: JobConfig, dec: Decisions, all_stages: bool, gather: str, first_only: bool = False) -> MemoryPlan:
    layout = dec.layout
    s = cfg.strategy
    unplanned = ""
    if model_spec(cfg.model).analytic:
        stages = plan_stages(cfg, layout, all_stages, gather or "whole", first_only)
    else:
        unplanned = skip_reason(cfg, layout) or ""
        stages = [_untraced_stage(cfg, layout) if unplanned else _traced_stage(cfg, layout)]
    worst = max(stages, key=lambda sp: sp.peak)
    hw = cfg.hardware
    overheads = {
        Line.CUDA_CONTEXT: hw.context_gib * GIB,
        Line.COMMUNICATOR_BUFFERS: hw.comm_buffers_gib * GIB,
        Line.ALLOCATOR_FRAGMENTATION: hw.fragmentation * worst.peak,
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
    notes = [] if model_spec(cfg.model).analytic else [UNTRACED_NOTE if unplanned else TRACED_NOTE]
    notes += peft_notes(cfg) + offload_notes(cfg)
    if layout.pp > 1 and int(s.zero_stage) >= 2 and layout.dp > 1:
        n_mb = dec.pp_microbatches
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
        host_ranks=ranks_per_node(cfg, layout.world),
        host_capacity=float(hw.host_memory_gib) * GIB,
        generation_gather=gather,
        unplanned=unplanned,
    )


TRACED_NOTE = (
    "no closed-form memory model for this model (model._target_, model.arch=hf_auto, or a family without one yet): "
    "planned by tracing one training step"
)
UNTRACED_NOTE = (
    "no closed-form memory model for this model, and its trace cannot run on this host: the figures are its "
    "weights alone"
)


def _untraced_stage(cfg: JobConfig, layout: Layout) -> StagePlan:
    """A lower bound where the trace cannot run here: the rank's share of the weights (trace.weights_lower_bound,
    the same figure the trace's refusal names), nothing else."""
    params = int(model_spec(cfg.model).param_count(cfg.model))
    weights = weights_lower_bound(cfg, layout)
    return StagePlan(
        stage=0,
        layers=int(cfg.model.n_layers),
        params=params,
        lines={Line.PARAMETERS: weights},
        phases={"untraced": weights},
        phase="untraced",
        peak=weights,
    )


def _traced_stage(cfg: JobConfig, layout: Layout) -> StagePlan:
    """The plan of a model without a closed-form memory model: one traced step of the real runtime
    on rank 0."""
    traced = trace_peak(cfg, layout, rank=0, fake=traced_with_fake_tensors(cfg, layout))
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
