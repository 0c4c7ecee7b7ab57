"""Layout search: every dp_replicate x dp_shard x cp x tp x pp x schedule x ZeRO x AC x micro-batch (and,
for a mixture of experts, expert-parallel degree) for the job's GPU count that fits, ranked by an
estimated step time.

Step time = compute (model FLOPs incl. recomputation, at the profile's peak x EFFICIENCY)
          + objective=grpo's rollout (dtlaunch.plan.generation_time: prefill, memory-bound decode steps,
            FSDP's gathers, the no-grad passes; only the layouts it can generate on are candidates)
          + exposed communication (per collective: message size / bandwidth of the link the group
            spans; overlappable collectives only count what compute cannot hide)
          + pipeline bubble ((p-1)/(v·m) of the pipelined compute).
Mesh order is pp (outer) x dp_replicate x dp_shard x cp x tp (inner), as the runtime builds it, so a
group is intra-node when its size times its stride fits in one node.
Pure Python: plain namespaces instead of OmegaConf in the loop keep 1,024 GPUs under a second.
"""

from __future__ import annotations

import copy
import heapq
from itertools import product
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout, expert_fsdp_degree
from dtlaunch.config.schema import CpStyle, ObjectiveName
from dtlaunch.job.rules.grpo import grpo_layout_problem
from dtlaunch.job.rules.objective import kto_layout_problem
from dtlaunch.job.rules.strategy import tensor_parallel_problem, zero_layout_problem
from dtlaunch.models.dtypes import DTYPE_BYTES
from dtlaunch.models.registry import model_spec, routed_experts
from dtlaunch.plan import hardware
from dtlaunch.plan.experts import a2a_volume_bytes, stage_routed_params
from dtlaunch.plan.generation_time import generation_seconds
from dtlaunch.plan.lines import Line
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.offload import offload_seconds, offload_variants
from dtlaunch.plan.peft import qlora_layout_ok
from dtlaunch.plan.ulysses_terms import qkv_width

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig, ModelConfig, TrainingConfig

EFFICIENCY = 0.55  # sustained fraction of peak for large matmuls
HIDDEN_FRACTION = 0.8  # share of overlappable communication that compute can hide at best
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1))
MICRO_BATCHES = (1, 2, 4, 8, 16)


def _ns(x: Any) -> Any:
    if isinstance(x, dict):
        return SimpleNamespace(**{k: _ns(v) for k, v in x.items()})
    return x


def _plain(cfg: JobConfig) -> Any:
    from omegaconf import DictConfig, OmegaConf

    return _ns(OmegaConf.to_container(cfg, resolve=True)) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def step_time(cfg: JobConfig, lay: Layout, v: int, n_mb: int, offloaded: float = 0.0) -> dict[str, float]:
    """Seconds per optimizer step by component. `offloaded`: activation bytes one micro-step moves to the
    host (training.activation_offload; the plan's pinned host line)."""
    m, t, hw = cfg.model, cfg.training, cfg.hardware
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    r = DTYPE_BYTES[cfg.precision.reduce_dtype]
    P = model_spec(m).param_count(m)
    dec = Decisions.of(cfg, lay)
    gb, accum = dec.global_batch, dec.grad_accum
    tokens = gb * t.seq_len
    # LoRA / QLoRA: the frozen base computes no weight gradients (4 FLOPs per parameter and token, not 6).
    per_param = 4 if str(cfg.peft.method) != "none" else 6
    flops_model = (per_param * P + 6 * m.n_layers * m.dim * t.seq_len) * tokens  # causal attention: half of 12·L·h·s
    if routed_experts(m):
        # A token multiplies only its top-k experts: the registry's count of active parameters.
        flops_model = model_spec(m).flops_per_token(m, t.seq_len) * tokens
    recompute = recompute_fraction(t)
    # A chunked loss (training.loss_chunks > 1) runs the head's matmul once more per token in backward.
    head_again = 2 * m.dim * m.vocab_size * tokens if dec.loss_chunks > 1 else 0
    compute = (flops_model * (1 + recompute) + head_again) / (
        lay.world * hardware.peak_flops(hw, cfg.precision.param_dtype) * EFFICIENCY
    )
    # Routed experts: split on their width by TP or among ranks by EP (never both); FSDP gathers them over
    # dp_shard / ep ranks only.
    routed = stage_routed_params(m, list(range(int(m.n_layers))))
    p_local = (P - routed) / (lay.tp * lay.pp)
    p_experts = routed / (lay.pp * lay.ep * lay.tp)
    tok_mb = t.micro_batch * t.seq_len // lay.cp  # tokens on one rank: CP splits each sequence
    comm_exposed = 0.0
    parts: dict[str, float] = {}
    if lay.cp > 1:
        bw = hardware.link_bandwidth(hw, lay.cp, lay.tp)
        if cfg.strategy.cp_style == CpStyle.ulysses:
            # Per layer: this rank's q, k, v and output all-to-all'd in forward, their gradients in backward
            # (dtlaunch.plan.ulysses_terms); each sends (cp - 1) / cp of one rank's share.
            hd = kv_width(m) // int(m.n_heads)
            kv = int(m.n_kv_heads or m.n_heads)
            width = qkv_width(int(m.n_heads), kv, hd, lay.tp, lay.cp) + kv_width(m) / lay.tp
            vol = (lay.cp - 1) / lay.cp * 2 * e * width * tok_mb * m.n_layers * accum
        else:
            # Per layer: K and V all-gathered in forward and again in backward, their fp32 gradients
            # reduce-scattered; not overlapped with the attention that waits for them.
            kv = 2 * t.micro_batch * t.seq_len * kv_width(m) / lay.tp
            vol = (lay.cp - 1) / lay.cp * kv * (2 * e + 4) * m.n_layers * accum
        parts["cp"] = vol / bw
        comm_exposed += parts["cp"]
    if lay.tp > 1:
        bw = hardware.link_bandwidth(hw, lay.tp, 1)
        # Per layer: all-gather + reduce-scatter around attention and MLP, forward and backward.
        vol = 8 * (lay.tp - 1) / lay.tp * tok_mb * m.dim * e * (m.n_layers / lay.pp) * accum
        if routed:
            # Every sparse block all-reduces its top_k routed copies' partial outputs in forward and their
            # input gradient in backward (dtlaunch.train.parallel.tensor_parallel.ExpertsTensorParallel).
            n_sparse = routed / max(1, _routed_per_sparse_block(m)) / lay.pp
            vol += 4 * (lay.tp - 1) / lay.tp * tok_mb * int(m.moe.top_k) * m.dim * e * n_sparse * accum
        parts["tp"] = vol / bw
        comm_exposed += parts["tp"]
    stride = lay.tp
    z = cfg.strategy.zero_stage
    if lay.shard > 1 and z >= 1:
        bw = hardware.link_bandwidth(hw, lay.shard, stride)
        frac = (lay.shard - 1) / lay.shard
        efsdp = expert_fsdp_degree(lay)
        # Per parameter bytes moved: all-gather(s) in the compute dtype + reduce-scatter in the reduce dtype.
        per_param = {3: (2 * e + r) * accum, 2: (e + r) * accum}.get(z, 2 * r + e)
        vol = frac * p_local * per_param
        if efsdp > 1:
            vol += (efsdp - 1) / efsdp * p_experts * per_param
        if lay.pp > 1 and z >= 2 and cfg.strategy.pp_reshard_grads:
            # A reduce-scatter after every pipeline micro-batch instead of one per micro-step (and, ZeRO-2,
            # the parameters gathered again for each micro-batch after its backward resharded them).
            vol += frac * p_local * (r + (e if z == 2 else 0)) * accum * (n_mb - 1)
        parts["fsdp"] = vol / bw
    elif lay.dp * lay.cp > 1 and z == 0:
        bw = hardware.link_bandwidth(hw, lay.dp * lay.cp, stride)
        parts["ddp"] = 2 * (lay.dp * lay.cp - 1) / (lay.dp * lay.cp) * p_local * r / bw
    if lay.dp_replicate > 1 and z >= 2:
        bw = hardware.link_bandwidth(hw, lay.dp_replicate, stride * lay.shard)
        parts["hsdp"] = 2 * (lay.dp_replicate - 1) / lay.dp_replicate * p_local / lay.shard * r / bw
    if lay.ep > 1:
        # Dispatch + combine, forward and backward, in every sparse block: on the critical path.
        bw = hardware.link_bandwidth(hw, lay.ep, stride)
        n_sparse = routed / max(1, _routed_per_sparse_block(m)) / lay.pp
        parts["ep"] = a2a_volume_bytes(cfg, lay.ep, tok_mb, e) * n_sparse * accum / bw
        comm_exposed += parts["ep"]
    overlap = sum(parts.get(k, 0.0) for k in ("fsdp", "ddp", "hsdp"))
    comm_exposed += max(overlap - HIDDEN_FRACTION * compute, (1 - HIDDEN_FRACTION) * overlap)
    bubble = compute * (lay.pp - 1) / (v * n_mb) if lay.pp > 1 else 0.0
    # Host offload (dtlaunch.plan.offload): copies on the host link hide behind compute at most as much as
    # communication does; the CPU optimizer step does not overlap.
    host = offload_seconds(cfg, dec, offloaded, p_local)
    transfer = host.get("activation_transfer", 0.0) + host.get("state_transfer", 0.0)
    offload_exposed = max(0.0, transfer - HIDDEN_FRACTION * compute) + host.get("cpu_optimizer", 0.0)
    if lay.pp > 1:
        bw = hardware.link_bandwidth(hw, 2, lay.tp * lay.dp)
        comm_exposed += 2 * tok_mb * m.dim * e / lay.tp * accum * v / bw
    generation = generation_seconds(cfg, dec, EFFICIENCY)
    return {
        "compute": compute,
        "comm": comm_exposed,
        "bubble": bubble,
        "offload": offload_exposed,
        "generation": generation,
        "total": compute + comm_exposed + bubble + offload_exposed + generation,
        "flops": flops_model,
    }


def _routed_per_sparse_block(m: ModelConfig) -> int:
    return 3 * routed_experts(m) * int(m.dim) * _expert_width(m) if routed_experts(m) else 0


def _expert_width(m: Any) -> int:
    from dtlaunch.models.moe.shapes import expert_dim

    return expert_dim(m)


def _ep_degrees(m: Any, shard: int, zero: int, cp: int, tp: int = 1) -> list[int]:
    """Expert-parallel degrees for a layout: 1, and with FSDP (no CP, no TP: job.rules.strategy's
    check_expert_parallel and check_moe_tensor_parallel) every divisor of dp_shard that splits the routed
    experts evenly."""
    experts = routed_experts(m)
    if not experts or zero < 2 or cp > 1 or tp > 1:
        return [1]
    return [d for d in _divisors(shard) if experts % d == 0]


def _ulysses_blocks(cfg: JobConfig) -> bool:
    """A family whose blocks take Ulysses' head exchange (registry `ulysses_blocks`: the Gated DeltaNet hybrids),
    planned with strategy.cp_style=ulysses."""
    return model_spec(cfg.model).ulysses_blocks and cfg.strategy.cp_style == CpStyle.ulysses


def _cp_tp_ok(cfg: JobConfig, cp: int, tp: int) -> bool:
    """cp context-parallel ranks at tensor-parallel degree tp: for Ulysses blocks, the family's rule
    (registry `ulysses_degree_ok`, the one its check_layout enforces)."""
    rule = model_spec(cfg.model).ulysses_degree_ok
    return cp == 1 or not _ulysses_blocks(cfg) or rule is None or rule(cfg.model, cp, tp)


def cp_degrees(cfg: JobConfig) -> list[int]:
    """Context-parallel degrees worth searching: those that split the sequence into 2·cp chunks on a
    registry decoder (or, under strategy.cp_style=ulysses, a family with Ulysses blocks whose rule some
    tensor-parallel degree meets); CP inside a node (its K/V exchange runs every block)."""
    m, t = cfg.model, cfg.training
    world = Layout.resolve(cfg.strategy, _world(cfg)).world
    per_node = int(cfg.hardware.gpus_per_node) or world
    if not (model_spec(m).ring_attention or _ulysses_blocks(cfg)) or getattr(cfg.data, "document_mask", False):
        return [1]
    window = getattr(m, "sliding_window", None)
    return [
        cp
        for cp in _divisors(world)
        if cp == 1
        or (
            cp <= per_node
            and t.seq_len % (2 * cp) == 0
            and (window is None or window >= t.seq_len)
            and any(_cp_tp_ok(cfg, cp, tp) for tp in _divisors(world // cp))
        )
    ]


def candidates(cfg: JobConfig, cp: int = 1) -> list[tuple[Layout, dict, dict]]:
    """(layout, strategy values, training values) for every combination worth planning, with `cp`
    context-parallel ranks (the other degrees fill world / cp)."""
    m, hw = cfg.model, cfg.hardware
    base = Decisions.of(cfg, Layout.resolve(cfg.strategy, _world(cfg)))
    world, gb = base.layout.world, base.global_batch
    per_node = int(hw.gpus_per_node) or world
    grpo = cfg.objective.name == ObjectiveName.grpo
    kto = cfg.objective.name == ObjectiveName.kto
    out = []
    for tp in _divisors(world // cp):
        # The rule validate applies (job.rules.strategy); every printed row is validated whole besides.
        if tp * cp > per_node or tensor_parallel_problem(cfg, tp) or not _cp_tp_ok(cfg, cp, tp):
            continue
        for pp in _divisors(world // (tp * cp)):
            if pp > m.n_layers or (pp > 1 and cp > 1):
                continue
            dp = world // (tp * pp * cp)
            for rep in _divisors(dp):
                shard = dp // rep
                if rep > 1 and (shard * cp * tp * pp) % per_node:
                    continue  # replicate across node groups only
                degrees = Layout(world=world, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp)
                for zero in (0, 1, 2, 3):
                    if zero_layout_problem(zero, degrees):
                        continue  # validate refuses it (job.rules.strategy.check_zero)
                    if (zero == 0 and rep > 1) or (zero == 1 and dp * cp == 1):
                        continue
                    if zero == 0 and cp > 1 and tp > 1:  # DDP cannot average DTensor gradients over CP
                        continue
                    if not qlora_layout_ok(cfg, tp, pp, rep * shard * cp if zero >= 2 else 1, rep):
                        continue  # job.rules.qlora: NF4 under FSDP2 or DDP, whole blocks per shard
                    scheds = SCHEDULES if pp > 1 else (("1f1b", 1),)
                    for sched, v in scheds:
                        if pp * v > m.n_layers:
                            continue
                        for mb in MICRO_BATCHES:
                            if gb % (mb * dp) or (pp > 1 and mb < pp):
                                continue
                            for ep, ac, chunks in product(
                                _ep_degrees(m, shard, zero, cp, tp),
                                ("none", "selective", "full"),
                                loss_chunk_options(cfg),
                            ):
                                lay = Layout(world=world, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep)
                                if grpo and grpo_layout_problem(cfg, Decisions.of(cfg, lay)):
                                    continue  # a layout validate refuses for objective=grpo
                                if kto and kto_layout_problem(cfg, lay, mb):
                                    continue  # and for objective=kto
                                st = {
                                    "dp_replicate": rep,
                                    "dp_shard": shard,
                                    "tp": tp,
                                    "pp": pp,
                                    "cp": cp,
                                    "zero_stage": zero,
                                    "pp_schedule": sched,
                                    "pp_stages_per_rank": v,
                                    "pp_microbatches": mb if pp > 1 else 0,
                                    "pp_layers_per_stage": [],
                                    "ep": ep,
                                    "pp_reshard_grads": False,
                                }
                                tr = {"micro_batch": mb, "global_batch": gb, "activation_checkpointing": ac}
                                out.append((lay, st, {**tr, "loss_chunks": chunks}))
    return out


def loss_chunk_options(cfg: JobConfig) -> tuple[int, ...]:
    """The full-vocabulary loss first (no recompute), then the chunked one (the config's count, or 8):
    a layout that fits with the cheaper option is not planned again with the costlier. One pass only
    for the preference objectives (config.decisions.Decisions.loss_chunks)."""
    if cfg.objective.name != ObjectiveName.sft:
        return (1,)
    chunks = int(cfg.training.loss_chunks)
    return (1, chunks if chunks > 1 else 8)


def _world(cfg: JobConfig) -> int:
    from dtlaunch.config.layout import world_size

    return world_size(cfg)


def search(cfg: JobConfig, top: int = 10) -> list[dict]:
    """The `top` fastest layouts that fit, each with why it loses to the first.

    Candidates are planned fastest first and only until `top` rows fit and pass the rules: a candidate's step
    time without offloading (cheap, no memory plan) bounds its row's from below, as offloading and a
    unit-by-unit generation gather only add time. A row is final once no candidate left could be faster
    (a heap of both, rows after candidates at equal times), so the rows are those, and in the order, that
    planning every candidate and sorting would give (tests/unit/test_plan_search_rules.py)."""
    plain = _plain(cfg)
    heap: list[tuple] = []
    for i, (lay, st, tr) in enumerate(c for cp in cp_degrees(plain) for c in candidates(plain, cp)):
        job = _candidate_job(plain, {**st, "cpu_offload": False}, {**tr, "activation_offload": False})
        bound = step_time(job, lay, st["pp_stages_per_rank"], st["pp_microbatches"] or 1)["total"]
        heapq.heappush(heap, (bound, 0, 0, i, (lay, st, tr)))
    fitted: set[tuple] = set()
    rows: list[dict] = []
    while heap and len(rows) < top:
        _, is_row, _, i, item = heapq.heappop(heap)
        if is_row:
            if _accepted(cfg, item):
                rows.append(item)
            continue
        row = _planned_row(plain, *item, fitted)
        if row is not None:
            heapq.heappush(heap, (row["step_s"], 1, row["device_total_bytes"], i, row))
    rows.sort(key=lambda r: (r["step_s"], r["device_total_bytes"]))  # (already so: the bound holds)
    for r in rows:
        r["why"] = _why(r, rows[0])
    return rows


def _candidate_job(plain: Any, st: dict, tr: dict) -> Any:
    job = copy.copy(plain)
    job.strategy = SimpleNamespace(**{**vars(plain.strategy), **st})
    job.training = SimpleNamespace(**{**vars(plain.training), **tr})
    return job


def _planned_row(plain: Any, lay: Layout, st: dict, tr: dict, fitted: set[tuple]) -> dict | None:
    """The candidate's row where it fits (offloading only where it does not fit without), else None.
    `fitted`: the layouts that fit with a lighter AC mode or the other loss chunks already (planned
    before this one, being faster): more recompute is only slower."""
    key = (lay, *(st[k] for k in sorted(st) if k != "pp_layers_per_stage"), tr["micro_batch"])
    if key in fitted:
        return None
    variants = offload_variants(plain, lay, st, tr)
    if not variants:
        return None
    # Offloading only moves bytes off the device: where the variant that offloads the most leaves no device
    # headroom, no other does (most of a large search's candidates; test_plan_search_rules checks the order).
    # Under PP a rank that does not fit is enough: the first, which holds the most micro-batches in flight,
    # is planned alone first.
    probe = _variant_plan(plain, lay, st, tr, variants[-1], first_only=lay.pp > 1)[2]
    if probe.headroom < 0:
        return None
    most = probe if lay.pp == 1 else None  # (else a plan of every rank that can hold the peak decides the fit)
    plan = None
    for variant in variants:
        st_v, tr_v, plan = _variant_plan(plain, lay, st, tr, variant, most if variant == variants[-1] else None)
        if plan.fits:
            st, tr = st_v, tr_v
            break
    if plan is None or not plan.fits:
        return None
    job = _candidate_job(plain, st, tr)
    fitted.add(key)
    if plan.generation_gather == "unit":  # the plan's choice under auto: its step time too
        job.objective = SimpleNamespace(**{**vars(plain.objective), "generation_gather": "unit"})
    n_mb = st["pp_microbatches"] or 1
    times = step_time(job, lay, st["pp_stages_per_rank"], n_mb, plan.worst.host.get(Line.HOST_ACTIVATIONS, 0.0))
    tokens = tr["global_batch"] * plain.training.seq_len
    peak = hardware.peak_flops(plain.hardware, plain.precision.param_dtype)
    return {
        **st,
        "ac": tr["activation_checkpointing"],
        "activation_offload": tr["activation_offload"],
        "loss_chunks": tr["loss_chunks"],
        "micro_batch": tr["micro_batch"],
        "schedule": st["pp_schedule"] if lay.pp > 1 else "-",
        "device_total_bytes": int(plan.device_total),
        "step_s": times["total"],
        "tokens_per_s": tokens / times["total"],
        "mfu": times["flops"] / times["total"] / (lay.world * peak),
        "times": times,
        "overrides": _overrides(st, tr, moe=bool(routed_experts(plain.model))),
    }


def _variant_plan(
    plain: Any,
    lay: Layout,
    st: dict,
    tr: dict,
    variant: tuple[bool, bool],
    planned: Any = None,
    first_only: bool = False,
) -> tuple:
    """(strategy, training, plan) of the candidate with offload `variant` (cpu_offload, activation_offload);
    `planned`: that plan, made already; `first_only`: plan the first pipeline rank only."""
    st, tr = {**st, "cpu_offload": variant[0]}, {**tr, "activation_offload": variant[1]}
    if planned is not None:
        return st, tr, planned
    return st, tr, plan_memory(_candidate_job(plain, st, tr), lay, all_stages=False, first_only=first_only)


def _accepted(cfg: JobConfig, row: dict) -> bool:
    """Whether the row's overrides, applied to the job, pass every config rule. The candidate loop prunes
    with a few of the rules (it may plan thousands of layouts); validate is the judge of what the search
    prints, so a row the user pastes is never refused (a rule added later is obeyed here too)."""
    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):  # a plain namespace (planner tests): nothing to validate against
        return True
    return not _refusal(cfg, row["overrides"])


def _refusal(cfg: JobConfig, overrides: list[str]) -> str:
    """validate's one-line refusal of the job with `overrides` applied ('' when it passes)."""
    import yaml
    from omegaconf import OmegaConf

    from dtlaunch.errors import ConfigError
    from dtlaunch.job.validate import validate

    job = copy.deepcopy(cfg)
    for ov in overrides:
        key, value = ov.split("=", 1)
        OmegaConf.update(job, key, yaml.safe_load(value), merge=False)
    try:
        validate(job)
    except ConfigError as exc:
        return str(exc)
    return ""


def _overrides(st: dict, tr: dict, moe: bool = False) -> list[str]:
    keys = (
        "dp_replicate",
        "dp_shard",
        "tp",
        "pp",
        "cp",
        "zero_stage",
        "pp_schedule",
        "pp_stages_per_rank",
        "pp_microbatches",
        "pp_reshard_grads",
    )
    if moe or st.get("ep", 1) > 1:  # a MoE recipe may set strategy.ep: the row says its own degree
        keys += ("ep",)
    if st.get("cpu_offload"):
        keys += ("cpu_offload",)
    return [f"strategy.{k}={str(st[k]).lower() if isinstance(st[k], bool) else st[k]}" for k in keys] + [
        f"training.{k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in tr.items()
        if k != "activation_offload" or v
    ]


def _why(row: dict, best: dict) -> str:
    if row is best:
        return "fastest"
    a, b = row["times"], best["times"]
    deltas = {name: a[name] - b[name] for name in ("compute", "comm", "bubble", "offload", "generation")}
    label = {
        "generation": "slower generation",
        "compute": "more recompute",
        "comm": "more exposed communication",
        "bubble": "larger pipeline bubble",
        "offload": "host offload traffic",
    }
    worst = max(deltas, key=lambda k: deltas[k])
    slower = (row["step_s"] / best["step_s"] - 1) * 100
    if deltas[worst] <= 0:
        return f"+{slower:.1f}% (ties; more memory)"
    return f"+{slower:.1f}%: {label[worst]}"


def kv_width(m: ModelConfig) -> int:
    """Width of K (= of V) per token as the ring exchanges it: K/V heads repeated to the query heads."""
    from dtlaunch.models.dense.shapes import head_dim

    return int(m.n_heads) * head_dim(m)


def recompute_fraction(t: TrainingConfig) -> float:
    """Extra compute of activation checkpointing, as a fraction of forward + backward (3 forwards).
    Full: one forward more (1/3). Op policy: the recomputed matmuls (wk, wo, w3) are about a third of a
    Llama block's forward flops (Llama-3.1-8B: 36 %), so ~0.12. Layer policy: full on 1 block in n.
    Memory budget: the partitioner recomputes the cheapest ops first; taken as the op policy's cost."""
    mode = t.activation_checkpointing
    if mode == "full":
        return 1 / 3
    if mode != "selective":
        return 0.0
    if t.ac_policy == "layer" and float(t.ac_memory_budget) == 0:
        return 1 / (3 * int(t.ac_every_n_layers))
    return 0.12
