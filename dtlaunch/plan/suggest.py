"""Fix suggestions: the smallest changes that make a plan fit, each validated and re-planned."""

from __future__ import annotations

import copy
import itertools
from typing import TYPE_CHECKING, Any, Callable, Optional

from dtlaunch.config.decisions import Decisions, offload_composes_with_compile
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.errors import DtlaunchError
from dtlaunch.plan.memory import MemoryPlan, plan_memory

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# A change: (description, cost, overrides). Lower cost = less disruptive (speed, code, hardware).
Change = tuple[str, int, list[str]]


def _changes(cfg: JobConfig, layout: Any) -> list[Change]:
    s, t, dec = cfg.strategy, cfg.training, Decisions.of(cfg, layout)
    out: list[Change] = []
    zero_ok = layout.tp == 1 and layout.dp_replicate == 1
    for z in (1, 2, 3):
        if z > s.zero_stage and layout.dp > 1 and (z != 1 or zero_ok):
            out.append((f"raise ZeRO stage to {z}", z, [f"strategy.zero_stage={z}"]))
    if layout.pp > 1 and s.zero_stage >= 2 and layout.dp > 1 and not s.pp_reshard_grads:
        # Only more reduce-scatters (one per pipeline micro-batch): no recompute, same numerics.
        out.append(("reduce-scatter gradients every pipeline micro-batch", 1, ["strategy.pp_reshard_grads=true"]))
    if cfg.objective.name == ObjectiveName.sft and dec.loss_chunks < 8:
        # The logits and their fp32 gradients, a chunk at a time: one more head matmul per token.
        out.append(("chunked loss (8 chunks)", 1, ["training.loss_chunks=8"]))
    order = ["none", "selective", "full"]
    for i, mode in enumerate(order):
        if i > order.index(t.activation_checkpointing):
            out.append((f"activation checkpointing {mode}", 2 + i, [f"training.activation_checkpointing={mode}"]))
    if cfg.precision.param_dtype == "fp32":
        out.append(("bf16 compute", 3, ["precision=bf16"]))
    if float(cfg.hardware.host_memory_gib):  # offloading (dtlaunch.plan.offload) needs a host figure
        if not dec.activation_offload:
            fix = ["training.activation_offload=true"]
            if t.compile and not offload_composes_with_compile(t.activation_checkpointing):
                fix.append("training.activation_checkpointing=full")  # offload under compile: config.decisions
            out.append(("offload activations to host memory", 4, fix))
        if not s.cpu_offload:
            out.append(("FSDP CPU offload (the optimizer steps on the host)", 7, ["strategy.cpu_offload=true"]))
    mb = int(t.micro_batch)
    gb, n_mb = dec.global_batch, dec.pp_microbatches
    smaller = mb // 2
    while smaller >= 1:
        if layout.pp == 1 or smaller % n_mb == 0:
            out.append(
                (
                    f"micro-batch {smaller}, more accumulation (same global batch)",
                    4,
                    [f"training.micro_batch={smaller}", f"training.global_batch={gb}"],
                )
            )
        smaller //= 2
    for deg in (2, 4, 8):
        cp = layout.cp * deg  # long sequences: split each over more ranks (validated like every change)
        if layout.pp == 1 and layout.world % (cp * layout.tp) == 0 and t.seq_len % (2 * cp) == 0:
            keep_batch = [f"training.global_batch={gb}"]
            out.append((f"context parallel {cp}", 5, [f"strategy.cp={cp}", "strategy.dp_shard=-1", *keep_batch]))
    for deg in (2, 4, 8):
        tp = layout.tp * deg
        if layout.world % (tp * layout.pp) == 0:
            out.append(
                (
                    f"tensor parallel {tp}",
                    5,
                    [
                        f"strategy.tp={tp}",
                        "strategy.dp_shard=-1",
                        "strategy.dp_replicate=1",
                        f"training.global_batch={gb}",
                    ],
                )
            )
        pp = layout.pp * deg
        if layout.world % (pp * layout.tp) == 0:
            new_mb = max(mb, pp)
            new_gb = max(gb, new_mb * layout.world // (pp * layout.tp))
            out.append(
                (
                    f"pipeline parallel {pp} (1F1B)",
                    6,
                    [
                        f"strategy.pp={pp}",
                        "strategy.dp_shard=-1",
                        "strategy.dp_replicate=1",
                        "strategy.pp_schedule=1f1b",
                        f"strategy.pp_microbatches={pp}",
                        f"training.micro_batch={new_mb}",
                        f"training.global_batch={new_gb}",
                    ],
                )
            )
    return out


def _apply(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    from omegaconf import OmegaConf

    new = copy.deepcopy(cfg)
    for ov in overrides:
        key, value = ov.split("=", 1)
        if key == "precision":  # the group option: bf16 compute, fp32 reduction (configs/precision/bf16.yaml)
            OmegaConf.update(new, "precision.param_dtype", value, merge=False)
            OmegaConf.update(new, "precision.reduce_dtype", "fp32", merge=False)
            continue
        OmegaConf.update(new, key, _parse(value), merge=False)
    return new


def _parse(value: str) -> Any:
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value, value)


def _try(cfg: JobConfig, overrides: list[str]) -> Optional[MemoryPlan]:
    from dtlaunch.job.validate import validate

    try:
        new = _apply(cfg, overrides)
        return plan_memory(new, validate(new).layout)
    except DtlaunchError:
        return None


def suggest(
    cfg: JobConfig, layout: Any, limit: int = 5, planner: Callable[..., Optional[MemoryPlan]] = _try
) -> list[dict]:
    """Up to `limit` single changes (then pairs) that fit, cheapest first; each passes validate()."""
    changes = _changes(cfg, layout)
    found: list[tuple[int, float, dict]] = []
    for size in (1, 2):
        for combo in itertools.combinations(changes, size):
            keys = [o.split("=")[0] for c in combo for o in c[2]]
            if len(keys) != len(set(keys)):
                continue
            overrides = [o for c in combo for o in c[2]]
            plan = planner(cfg, overrides)
            if plan is None or not plan.fits:
                continue
            found.append(
                (
                    sum(c[1] for c in combo),
                    -plan.headroom,
                    {
                        "change": " + ".join(c[0] for c in combo),
                        "overrides": overrides,
                        "peak_bytes": int(plan.peak),
                        "device_total_bytes": int(plan.device_total),
                        "headroom_bytes": int(plan.headroom),
                    },
                )
            )
        if found:
            break
    found.sort(key=lambda f: (f[0], f[1]))
    return [f[2] for f in found[:limit]]
