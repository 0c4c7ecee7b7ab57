"""What offloading moves off the device, and what it costs the host and the step.

`training.activation_offload` (dtlaunch.train.features.offload_activations): every tensor a block saves for backward
goes to pinned host memory; a checkpointed block's saved set is its input (inside a checkpointed region
the checkpoint keeps its own tensors: selective AC's kept matmul outputs stay on the device), a block
without AC moves its whole saved set (RoPE casts included; not autocast's weight copies). The embedding's,
the final norm's and the logits' stay. In backward one block's set is on the device again at a time.

`strategy.cpu_offload` (dtlaunch.train.parallel.cpu_offload): the fp32 parameter shards, the gradients
and the optimizer state (and the CPU optimizer's temporaries) live on the host; the device keeps the
gathered units, the activations and, per unit, the fp32 shard copied in for its all-gather.

The device lines shrink by exactly the host lines of the same names (`split`); the node's host RAM holds
every rank's host lines (`host_per_node`). Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.config.decisions import Decisions, offload_composes_with_compile
from dtlaunch.plan.lines import ON_HOST, Line

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Static lines FSDP's CPU offload keeps on the host (each reported as its dtlaunch.plan.lines.ON_HOST line).
CPU_OFFLOADED = (Line.PARAMETERS, Line.ADAPTER_PARAMETERS, Line.OPTIMIZER_STATE, Line.ACCUMULATED_GRADIENTS)
# The CPU optimizer's lines at the step.
CPU_OFFLOADED_AT_STEP = (Line.GRADIENTS, Line.OPTIMIZER_TEMPORARIES)
# A block without AC in its backward holds at once about the MLP's F-wide tensors (w1 and w3 outputs, SiLU
# output) and the MLP input of its reloaded set, not the whole set (unpacking is lazy; 2-process CPU runs,
# bench/offload_accuracy.py).
# Not measured by a test: bench/offload_accuracy.py measures it on 2-process CPU runs.
RELOADED_F_WIDE_TENSORS = 3
# No profile figure for the host link: PCIe 4.0 x16's typical achieved bandwidth.
DEFAULT_HOST_LINK_GBPS = 25.0
# Parameters a node's CPUs update per second in the CPU optimizer step (vectorised fused AdamW over
# fp32 state on a two-socket server): an assumption, not a measurement of this code.
CPU_ADAM_PARAMS_PER_S = 2e9


def activation_offload(c: Any) -> bool:
    return c.decisions.activation_offload


def cpu_offload(c: Any) -> bool:
    return bool(c.cfg.strategy.cpu_offload) and c.fsdp


def moved_block_per_token(c: Any, kind: str) -> float:
    """Saved bytes per token of one block of a checkpointing kind that the offload hooks move."""
    if kind == "none":
        return c.block_saved_per_token["none"]
    # A checkpointed block: only its input goes through the hooks (the full-AC set is the input).
    return c.activation_model.block_bytes(
        c.block_dims, c.compute_bytes, "full", c.tp, c.sequence_parallel, c.fp32_residual, c.compiled
    )


def moved_per_token(c: Any) -> float:
    """Saved bytes per token of the stage's blocks that move to the host (every kind of its AC mix)."""
    if not activation_offload(c):
        return 0.0
    moved = sum(n * moved_block_per_token(c, k) for k, n in c.ac_mix.items())
    if c.peft:
        moved += c.blocks_without_ac * c.peft.act_block + (
            c.peft.act_first if c.first_stage and c.blocks_without_ac else 0.0
        )
    return moved


def _reloaded_per_token(c: Any, kind: str) -> float:
    """Saved bytes per token of one block back on the device at once in its backward. Unpacking is lazy:
    a tensor comes back when its node runs and goes when no later node needs it, so a block without AC
    holds about the MLP's F-wide tensors (w1 and w3 outputs, SiLU output) and the MLP input at once, not
    its whole set (measured: 2-process CPU runs, bench/offload_accuracy.py). A checkpointed block: its input."""
    whole = moved_block_per_token(c, kind)
    return (
        min(whole, c.compute_bytes * (RELOADED_F_WIDE_TENSORS * c.block_dims.f / c.tp + c.block_dims.h))
        if kind == "none"
        else whole
    )


def reloaded_block(c: Any) -> float:
    """Bytes of the moved activations back on the device while backward runs through a block."""
    if not activation_offload(c) or not c.layers:
        return 0.0
    per_tok = max(_reloaded_per_token(c, k) for k, n in c.ac_mix.items() if n)
    if c.peft and c.blocks_without_ac:
        per_tok += c.peft.act_block + c.peft.adapter_act
    return per_tok * c.tokens


def moved_activation_lines(c: Any) -> dict[str, float]:
    """The forward lines' bytes that the hooks move: the blocks' activations (RoPE casts included) and
    LoRA's; autocast's weight copies stay (its cast cache holds them through forward)."""
    if not activation_offload(c):
        return {}
    rope = (
        c.activation_model.rope_cast_bytes(c.block_dims, c.compute_bytes, int(c.training.seq_len) // c.cp)
        * c.blocks_without_ac
        if c.fp32_residual and not c.compiled
        else 0.0
    )
    moved = {
        Line.ACTIVATIONS: (
            moved_per_token(c) * c.tokens
            + rope * (c.training.micro_batch // c.pp_microbatches) / c.training.micro_batch
        )
    }
    moved[Line.ACTIVATIONS] *= c.microbatches_in_flight
    if c.peft:
        moved[Line.LORA_ACTIVATIONS] = c.blocks_without_ac * c.peft.adapter_act * c.tokens * c.microbatches_in_flight
    return moved


def split(c: Any, lines: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(device lines, host lines): each moved byte leaves the device line and joins the host."""
    device = dict(lines)
    host: dict[str, float] = {}
    moved = dict(moved_activation_lines(c))
    if cpu_offload(c):
        moved.update({k: lines[k] for k in CPU_OFFLOADED if k in lines})
    for k, v in moved.items():
        if k not in device:
            continue
        v = min(v, device[k])
        device[k] -= v
        name = ON_HOST[k]
        host[name] = host.get(name, 0.0) + v
    return device, host


def split_at_step(c: Any, lines: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The optimizer step's (device, host) lines: under CPU offload the gradients and the CPU optimizer's
    temporaries are on the host too."""
    if not cpu_offload(c):
        return lines, {}
    device = {k: v for k, v in lines.items() if k not in CPU_OFFLOADED_AT_STEP}
    return device, {ON_HOST[k]: v for k, v in lines.items() if k in CPU_OFFLOADED_AT_STEP}


def host_peak_lines(host: dict[str, float], host_at_step: dict[str, float]) -> dict[str, float]:
    """The host lines at the larger of the two host moments: through forward and backward (states and
    pinned activations), or at the optimizer step (states, complete gradients, the step's temporaries)."""
    at_step = {k: v for k, v in host.items() if k not in (Line.HOST_ACTIVATIONS, Line.ACCUMULATED_GRADIENTS_HOST)}
    at_step.update(host_at_step)
    return host if sum(host.values()) >= sum(at_step.values()) else at_step


def staging_bytes(c: Any) -> float:
    """CPU offload: one unit's fp32 shard copied to the device for its all-gather. On one rank FSDP2 skips
    the all-gather and copies each parameter in on its own (FSDPParamGroup.wait_for_unshard's world-size-1
    path): the largest parameter of a block is what exists at once."""
    if not cpu_offload(c):
        return 0.0
    if c.shard_ranks == 1:
        return 4 * _largest_block_param(c)
    return 4 * c.gathered_block_params / c.shard_ranks


def _largest_block_param(c: Any) -> float:
    """The largest weight of one block, from the model family's block linears (the whole block where the
    family does not list them)."""
    from dtlaunch.models.registry import model_spec

    linears = model_spec(c.model).block_linears
    if linears is None:
        return float(c.gathered_block_params)
    return float(max(out_f * in_f for out_f, in_f, _ in linears(c.model).values()))


def ranks_per_node(cfg: JobConfig, world: int) -> int:
    per_node = int(cfg.hardware.gpus_per_node) or int(cfg.launch.nproc_per_node) or world
    return max(1, min(per_node, world))


def offload_seconds(cfg: JobConfig, dec: Decisions, stage_moved: float, params_local: float) -> dict[str, float]:
    """Seconds per optimizer step the host link and the CPU optimizer take.

    `stage_moved`: activation bytes one micro-step moves (device to host in forward, back in backward);
    `params_local`: parameters on one rank before FSDP sharding. CPU offload moves each unit's fp32 shard
    in per all-gather (ZeRO-3: forward and backward; ZeRO-2: once) and the reduce dtype's gradient shard
    out per micro-step, then steps every rank's shard on the node's CPUs."""
    from dtlaunch.models.dtypes import DTYPE_BYTES

    bw = (float(cfg.hardware.host_link_gbps) or DEFAULT_HOST_LINK_GBPS) * 1e9
    lay, accum = dec.layout, dec.grad_accum
    out = {"activation_transfer": 2 * stage_moved * accum / bw if dec.activation_offload else 0.0}
    if cfg.strategy.cpu_offload and int(cfg.strategy.zero_stage) >= 2:
        shard = params_local / lay.shard
        gathers = 2 if int(cfg.strategy.zero_stage) == 3 else 1
        r = DTYPE_BYTES[cfg.precision.reduce_dtype]
        out["state_transfer"] = (4 * gathers + r) * shard * accum / bw
        out["cpu_optimizer"] = shard * ranks_per_node(cfg, lay.world) / CPU_ADAM_PARAMS_PER_S
    return out


def offload_notes(cfg: JobConfig) -> list[str]:
    if not (cfg.training.activation_offload or cfg.strategy.cpu_offload) or int(cfg.hardware.gpus_per_node):
        return []
    return ["offloading on a CPU profile: host and device are the same RAM, so nothing really moves"]


def offload_variants(cfg: JobConfig, lay: Any, st: dict, tr: dict) -> list[tuple[bool, bool]]:
    """(strategy.cpu_offload, training.activation_offload) pairs the layout search tries for one
    candidate, in order: none, activations, CPU offload, both; only those job.rules.offload allows,
    and none but the first on a profile without host_memory_gib. FSDP over one rank exists only to offload
    (config.decisions.Decisions.fsdp): such a candidate is tried with CPU offload or not at all."""
    one_rank_fsdp = int(st["zero_stage"]) >= 2 and lay.dp * lay.cp == 1
    if not float(cfg.hardware.host_memory_gib):
        return [] if one_rank_fsdp else [(False, False)]
    act = lay.pp == 1 and (not cfg.training.compile or offload_composes_with_compile(tr["activation_checkpointing"]))
    cpu = int(st["zero_stage"]) >= 2 and lay.tp == lay.pp == lay.ep == 1
    cpu = cpu and cfg.precision.float8 == "none" and str(cfg.peft.method) != "qlora"
    if one_rank_fsdp:
        return [(True, False), (True, True)][: 2 if act else 1] if cpu else []
    out = [(False, False)]
    if act:
        out.append((False, True))
    if cpu:
        out.append((True, False))
    if act and cpu:
        out.append((True, True))
    return out
