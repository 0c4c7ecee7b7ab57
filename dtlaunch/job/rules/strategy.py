"""The parallel layout: degrees against the world and the model (tensor, context, pipeline and expert parallel, ZeRO)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.layout import Layout, pp_stage_layers, ulysses_kv_heads, world_size
from dtlaunch.config.schema import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, SPLIT_BACKWARD, CpStyle
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check_layout(cfg: JobConfig, notes: list[str]) -> Layout:
    return Layout.resolve(cfg.strategy, world_size(cfg))


def check_tensor_parallel(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    problem = tensor_parallel_problem(cfg, d.layout.tp)
    if problem:
        raise ConfigError(problem)


def tensor_parallel_problem(cfg: JobConfig, tp: int) -> str:
    """Why the model cannot run at tensor-parallel degree `tp` ('' when it can): the rule `validate` applies
    and the one `plan --search` prunes its candidates with."""
    if tp == 1:
        return ""
    from dtlaunch.models.registry import model_spec

    m = cfg.model
    if getattr(m, "qk_norm_whole", False):
        return (
            f"strategy.tp={tp} is not supported with model.arch={m.arch}: its q/k RMSNorm spans every head "
            f"of the projection (model.qk_norm_whole), which a rank holding some heads cannot compute alone: use strategy.tp=1"
        )
    for key, value in model_spec(m).tp_divisors(m):
        if value % tp:
            return f"strategy.tp={tp} does not divide {key}={value} (model.arch={m.arch}): choose a tp that divides it"
    if cfg.strategy.sequence_parallel and cfg.training.seq_len % tp:
        return (
            f"training.seq_len={cfg.training.seq_len} is not divisible by strategy.tp={tp} "
            f"(sequence parallel shards the sequence): change seq_len or set strategy.sequence_parallel=false"
        )
    return ""


def check_context_parallel(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    """strategy.cp: 2·cp equal chunks per sequence (load balancing), plain causal attention of a
    registry decoder, and the layouts the ring attention composes with."""
    layout = d.layout
    cp = layout.cp
    if cp == 1:
        return
    m, s, t = cfg.model, cfg.strategy, cfg.training
    if t.seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len={t.seq_len} does not split into 2 x strategy.cp = {2 * cp} equal chunks "
            f"(context parallel balances causal work with two chunks per rank): use a multiple of {2 * cp}"
        )
    local = t.seq_len // cp
    if layout.tp > 1 and s.sequence_parallel and local % layout.tp:
        raise ConfigError(
            f"each context-parallel rank holds {local} tokens (training.seq_len={t.seq_len} / strategy.cp={cp}), "
            f"not divisible by strategy.tp={layout.tp} for sequence parallel: change seq_len or set "
            f"strategy.sequence_parallel=false"
        )
    from dtlaunch.models.registry import model_spec

    spec = model_spec(m)
    if s.cp_style == CpStyle.ulysses:
        check_ulysses(cfg, layout, notes)
    elif not spec.ring_attention:
        fix = "strategy.cp_style=ulysses" if spec.hf_attention or spec.ulysses_blocks else "strategy.cp=1"
        raise ConfigError(
            f"strategy.cp={cp} with ring attention needs a registry decoder's swappable attention: use {fix} "
            f"for model.arch={m.arch}"
        )
    if layout.pp > 1:
        raise ConfigError(
            f"strategy.cp={cp} with strategy.pp={layout.pp} is not supported (pipeline stages pass only hidden "
            f"states, not the chunks' positions): use strategy.pp=1"
        )
    if cfg.data.document_mask:
        raise ConfigError(
            f"data.document_mask=true is not supported with strategy.cp={cp} (context parallel attention is plain causal): "
            f"set data.document_mask=false or strategy.cp=1"
        )
    if t.compile:
        raise ConfigError(
            f"training.compile=true is not supported with strategy.cp={cp} yet: set training.compile=false"
        )
    if int(s.zero_stage) == 0 and layout.tp > 1:
        raise ConfigError(
            f"strategy.zero_stage=0 (DDP) cannot average gradients over strategy.cp={cp} ranks with "
            f"strategy.tp={layout.tp}: use strategy.zero_stage=2 or 3 (FSDP)"
        )


def check_ulysses(cfg: JobConfig, layout: Layout, notes: list[str]) -> None:
    """strategy.cp_style=ulysses: every rank attends over the whole sequence for (heads / tp) / cp of the
    query heads, so cp must divide them; K/V heads that cp does not divide are repeated (grouped-query
    attention: config.layout.ulysses_kv_heads). The model's attention must be swappable: a registry
    decoder's or transformers' (model.arch=hf_auto)."""
    from dtlaunch.models.registry import model_spec

    m, cp, tp = cfg.model, layout.cp, layout.tp
    spec = model_spec(m)
    if not (spec.ring_attention or spec.hf_attention or spec.ulysses_blocks):
        raise ConfigError(
            f"strategy.cp_style=ulysses needs a registry decoder or model.arch=hf_auto (a swappable attention), "
            f"not model.arch={m.arch}: use strategy.cp=1"
        )
    heads = int(m.n_heads) // tp
    if heads % cp:
        per_rank = f" ({heads} per tensor-parallel rank)" if tp > 1 else ""
        raise ConfigError(
            f"strategy.cp_style=ulysses shards attention heads over strategy.cp={cp}, but model.n_heads="
            f"{m.n_heads}{per_rank} does not divide by it: use a cp that divides {heads} or strategy.cp_style=ring"
        )
    kv = int(m.n_kv_heads or m.n_heads) // tp
    if ulysses_kv_heads(kv, cp) != kv:
        notes.append(
            f"strategy.cp_style=ulysses: {kv} K/V heads per rank do not divide by strategy.cp={cp}; each is "
            f"repeated to {ulysses_kv_heads(kv, cp)} heads for the all-to-all"
        )


def check_pipeline(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    s = cfg.strategy
    name = s.pp_schedule
    if name not in PP_SCHEDULES and not name.startswith("Schedule"):
        raise ConfigError(
            f"strategy.pp_schedule='{name}' is unknown: use one of {', '.join(PP_SCHEDULES)} "
            f"or a torch.distributed.pipelining class name"
        )
    if layout.pp > 1 and cfg.model.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true cannot run with strategy.pp={layout.pp} (the embedding and the head "
            f"would live on different pipeline stages): use strategy.pp=1"
        )
    if layout.pp == 1:
        if s.pp_layers_per_stage:
            raise ConfigError("strategy.pp_layers_per_stage is set but strategy.pp=1: remove it or set strategy.pp")
    if s.pp_reshard_grads and (layout.pp == 1 or s.zero_stage < 2 or layout.dp == 1):
        raise ConfigError(
            f"strategy.pp_reshard_grads=true applies to FSDP under a pipeline (strategy.pp > 1, zero_stage 2 or 3, "
            f"dp > 1), not to pp={layout.pp}, zero_stage={s.zero_stage}, dp={layout.dp}: remove it"
        )
    if s.pp_reshard_grads and any(k in PP_SCHEDULES.get(name, name) for k in SPLIT_BACKWARD):
        # These schedules compute input gradients before weight gradients: a per-micro-batch
        # reduce-scatter would run before the weight gradients exist.
        raise ConfigError(
            f"strategy.pp_reshard_grads=true cannot run with strategy.pp_schedule={name} (it splits backward "
            f"into input and weight passes): use pp_schedule=1f1b, gpipe or interleaved_1f1b, or remove it"
        )
    if layout.pp == 1:
        return
    if s.pp_stages_per_rank < 1:
        raise ConfigError(f"strategy.pp_stages_per_rank={s.pp_stages_per_rank} must be >= 1")
    multi = name in MULTI_STAGE_SCHEDULES or any(k in name for k in ("Interleaved", "Looped", "ZBV", "DualPipe"))
    if multi and s.pp_stages_per_rank < 2:
        raise ConfigError(
            f"strategy.pp_schedule={name} runs several stages per rank: set strategy.pp_stages_per_rank=2 (or more)"
        )
    # V-shaped schedules (ZBV, DualPipeV) place exactly two stages per rank.
    if (name == "zbv" or name.endswith(("ZBVZeroBubble", "DualPipeV"))) and s.pp_stages_per_rank != 2:
        raise ConfigError(
            f"strategy.pp_schedule={name} places exactly 2 stages per rank in a V: set strategy.pp_stages_per_rank=2"
        )
    if not multi and s.pp_stages_per_rank != 1:
        raise ConfigError(
            f"strategy.pp_schedule={name} runs one stage per rank but strategy.pp_stages_per_rank="
            f"{s.pp_stages_per_rank}: use pp_schedule=interleaved_1f1b or pp_stages_per_rank=1"
        )
    stages = layout.pp * s.pp_stages_per_rank
    n_layers = cfg.model.n_layers
    if stages > n_layers:
        raise ConfigError(
            f"{stages} pipeline stages (strategy.pp={layout.pp} x pp_stages_per_rank={s.pp_stages_per_rank}) "
            f"exceed model.n_layers={n_layers}: lower strategy.pp"
        )
    if s.pp_layers_per_stage:
        split = list(s.pp_layers_per_stage)
        if len(split) != stages or sum(split) != n_layers or min(split) < 1:
            raise ConfigError(
                f"strategy.pp_layers_per_stage={split} must list {stages} positive counts summing to "
                f"model.n_layers={n_layers}"
            )
    split = pp_stage_layers(n_layers, stages, list(s.pp_layers_per_stage))
    if len(set(split)) > 1:
        notes.append(f"uneven pipeline split: layers per stage {split}")
    n_mb = d.pp_microbatches
    if n_mb < layout.pp:
        raise ConfigError(
            f"strategy.pp_microbatches={n_mb} is fewer than the {layout.pp} pipeline ranks: the pipeline "
            f"would idle; set strategy.pp_microbatches>={layout.pp}"
        )
    if cfg.training.micro_batch % n_mb:
        raise ConfigError(
            f"training.micro_batch={cfg.training.micro_batch} is not divisible by strategy.pp_microbatches="
            f"{n_mb}: each pipeline micro-batch needs a whole number of samples"
        )


def check_moe_tensor_parallel(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    """Tensor parallel splits each routed expert on its width (dtlaunch.models.moe.tp_plan); expert parallel
    splits the experts among ranks. Both at once would split the same 3-D parameters twice, which the
    dispatch does not do yet."""
    layout = d.layout
    from dtlaunch.models.registry import routed_experts

    if layout.tp == 1 or layout.ep == 1 or not routed_experts(cfg.model):
        return
    raise ConfigError(
        f"strategy.tp={layout.tp} with strategy.ep={layout.ep}: tensor parallel already splits every routed "
        f"expert on its width, and splitting them among expert-parallel ranks too is not supported yet: "
        f"set strategy.ep=1 (tensor parallel) or strategy.tp=1 (expert parallel)"
    )


def check_expert_parallel(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    """strategy.ep: a MoE model, FSDP, and a degree dividing both the experts and the shard ranks."""
    layout = d.layout
    ep = layout.ep
    if ep == 1:
        return
    from dtlaunch.models.registry import routed_experts

    experts = routed_experts(cfg.model)
    if not experts:
        raise ConfigError(
            f"strategy.ep={ep} splits routed experts, but model.arch={cfg.model.arch} has none: use strategy.ep=1 "
            f"or a mixture-of-experts model"
        )
    if experts % ep:
        raise ConfigError(
            f"strategy.ep={ep} does not divide model.moe.num_experts={experts}: choose an ep that divides it "
            f"(each rank holds num_experts/ep experts)"
        )
    if int(cfg.strategy.zero_stage) < 2:
        raise ConfigError(
            f"strategy.ep={ep} needs FSDP for the parameters it does not split: set strategy.zero_stage=2 or 3 "
            f"(it is {cfg.strategy.zero_stage})"
        )
    if layout.cp > 1:
        raise ConfigError(
            f"strategy.ep={ep} with strategy.cp={layout.cp} is not supported yet: use expert parallel or "
            f"context parallel (strategy.ep=1 or strategy.cp=1)"
        )
    if layout.dp_shard % ep:
        raise ConfigError(
            f"strategy.ep={ep} does not divide the data-parallel shard ranks it is taken from "
            f"(strategy.dp_shard={layout.dp_shard}): choose an ep that divides it, or raise strategy.dp_shard"
        )


def check_zero(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    z = cfg.strategy.zero_stage
    if z not in (0, 1, 2, 3):
        raise ConfigError(f"strategy.zero_stage={z} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3 (FSDP full shard)")
    problem = zero_layout_problem(z, layout)
    if problem:
        raise ConfigError(problem)
    if z in (2, 3) and layout.shard == 1 and layout.dp_replicate > 1:
        notes.append("zero_stage with dp_shard=1 shards nothing: parameters are only replicated")


def zero_layout_problem(z: int, layout: Layout) -> str:
    """Why ZeRO stage `z` cannot run on `layout` ("" when it can); `check_zero` refuses it and `plan --search`
    skips it."""
    if z == 0 and layout.tp > 1 and layout.dp > 1:
        return (
            f"strategy.zero_stage=0 (DDP) cannot combine with strategy.tp={layout.tp} over dp={layout.dp} ranks: "
            f"use strategy.zero_stage=2 or 3 (FSDP) for data x tensor parallel"
        )
    if z == 1 and (layout.tp > 1 or layout.dp_replicate > 1):
        return (
            f"strategy.zero_stage=1 shards the optimizer over plain DDP and cannot combine with "
            f"tp={layout.tp}/dp_replicate={layout.dp_replicate}: use strategy.zero_stage=2 or 3"
        )
    return ""
