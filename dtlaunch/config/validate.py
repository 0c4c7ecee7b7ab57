"""Cross-field rules: small functions, each raising a ConfigError that names key, value and fix.

`validate(cfg)` runs them in a fixed order and returns the resolved layout plus notes worth showing
(things that are allowed but surprising, like an uneven pipeline split).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from dtlaunch.config.layout import Layout, global_batch, pp_microbatches, pp_stage_layers, world_size
from dtlaunch.config.long_context_rules import check_mlp_tiles
from dtlaunch.config.objective_rules import check_objective
from dtlaunch.config.offload_rules import check_offload
from dtlaunch.config.optim_rules import check_optim
from dtlaunch.config.peft_rules import check_peft
from dtlaunch.config.qlora_rules import check_qlora
from dtlaunch.config.ranges import check_ranges
from dtlaunch.config.tokenizer_choice import effective_tokenizer, model_tokenizer_file, tokenizer_problem
from dtlaunch.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16")
AC_MODES = ("none", "selective", "full")
AC_POLICIES = ("op", "layer")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
# Schedules by our name -> torch.distributed.pipelining class; other torch class names also work.
PP_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
MULTI_STAGE_SCHEDULES = {"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv"}
# Schedules whose backward runs as separate input- and weight-gradient passes.
SPLIT_BACKWARD = ("ZeroBubble", "ZBV", "DualPipe")


@dataclass
class Validated:
    layout: Layout
    notes: list[str] = field(default_factory=list)


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def check_model_shape(cfg: Any, notes: list[str]) -> None:
    """The fields the model's family fixes, then the family's own rules (its registry entry's `check`)."""
    from omegaconf import OmegaConf

    from dtlaunch.models.registry import model_spec

    m = cfg.model
    spec = model_spec(m)
    for key, value in spec.fixed.items():
        if OmegaConf.select(m, key) != value:
            _fail(
                f"model.{key}={OmegaConf.select(m, key)} does not fit model.arch={m.arch} (which has {key}={value}): "
                f"drop the override or pick the model.arch that has it"
            )
    spec.check_config(cfg)


def check_layout(cfg: Any, notes: list[str]) -> Layout:
    return Layout.resolve(cfg.strategy, world_size(cfg))


def check_tensor_parallel(cfg: Any, layout: Layout, notes: list[str]) -> None:
    if layout.tp == 1:
        return
    from dtlaunch.models.registry import model_spec

    m = cfg.model
    for key, value in model_spec(m).tp_divisors(m):
        if value % layout.tp:
            _fail(
                f"strategy.tp={layout.tp} does not divide {key}={value} (model.arch={m.arch}): choose a tp that divides it"
            )
    if cfg.strategy.sequence_parallel and cfg.training.seq_len % layout.tp:
        _fail(
            f"training.seq_len={cfg.training.seq_len} is not divisible by strategy.tp={layout.tp} "
            f"(sequence parallel shards the sequence): change seq_len or set strategy.sequence_parallel=false"
        )


def check_context_parallel(cfg: Any, layout: Layout, notes: list[str]) -> None:
    """strategy.cp: 2·cp equal chunks per sequence (load balancing), plain causal attention of a
    registry decoder, and the layouts the ring attention composes with."""
    cp = layout.cp
    if cp == 1:
        return
    m, s, t = cfg.model, cfg.strategy, cfg.training
    if t.seq_len % (2 * cp):
        _fail(
            f"training.seq_len={t.seq_len} does not split into 2 x strategy.cp = {2 * cp} equal chunks "
            f"(context parallel balances causal work with two chunks per rank): use a multiple of {2 * cp}"
        )
    local = t.seq_len // cp
    if layout.tp > 1 and s.sequence_parallel and local % layout.tp:
        _fail(
            f"each context-parallel rank holds {local} tokens (training.seq_len={t.seq_len} / strategy.cp={cp}), "
            f"not divisible by strategy.tp={layout.tp} for sequence parallel: change seq_len or set "
            f"strategy.sequence_parallel=false"
        )
    from dtlaunch.models.registry import model_spec

    if not model_spec(m).ring_attention:
        _fail(f"strategy.cp={cp} needs a registry decoder's swappable attention: use strategy.cp=1 for this model")
    if layout.pp > 1:
        _fail(
            f"strategy.cp={cp} with strategy.pp={layout.pp} is not supported (pipeline stages pass only hidden "
            f"states, not the chunks' positions): use strategy.pp=1"
        )
    if cfg.data.document_mask:
        _fail(
            f"data.document_mask=true is not supported with strategy.cp={cp} (ring attention is plain causal): "
            f"set data.document_mask=false or strategy.cp=1"
        )
    if t.compile:
        _fail(f"training.compile=true is not supported with strategy.cp={cp} yet: set training.compile=false")
    if int(s.zero_stage) == 0 and layout.tp > 1:
        _fail(
            f"strategy.zero_stage=0 (DDP) cannot average gradients over strategy.cp={cp} ranks with "
            f"strategy.tp={layout.tp}: use strategy.zero_stage=2 or 3 (FSDP)"
        )


def check_pipeline(cfg: Any, layout: Layout, notes: list[str]) -> None:
    s = cfg.strategy
    name = s.pp_schedule
    if name not in PP_SCHEDULES and not name.startswith("Schedule"):
        _fail(
            f"strategy.pp_schedule='{name}' is unknown: use one of {', '.join(PP_SCHEDULES)} "
            f"or a torch.distributed.pipelining class name"
        )
    if layout.pp > 1 and cfg.model.tie_embeddings:
        _fail(
            f"model.tie_embeddings=true cannot run with strategy.pp={layout.pp} (the embedding and the head "
            f"would live on different pipeline stages): use strategy.pp=1"
        )
    if layout.pp == 1:
        if s.pp_layers_per_stage:
            _fail("strategy.pp_layers_per_stage is set but strategy.pp=1: remove it or set strategy.pp")
    if s.pp_reshard_grads and (layout.pp == 1 or s.zero_stage < 2 or layout.dp == 1):
        _fail(
            f"strategy.pp_reshard_grads=true applies to FSDP under a pipeline (strategy.pp > 1, zero_stage 2 or 3, "
            f"dp > 1), not to pp={layout.pp}, zero_stage={s.zero_stage}, dp={layout.dp}: remove it"
        )
    if s.pp_reshard_grads and any(k in PP_SCHEDULES.get(name, name) for k in SPLIT_BACKWARD):
        # These schedules compute input gradients before weight gradients: a per-micro-batch
        # reduce-scatter would run before the weight gradients exist.
        _fail(
            f"strategy.pp_reshard_grads=true cannot run with strategy.pp_schedule={name} (it splits backward "
            f"into input and weight passes): use pp_schedule=1f1b, gpipe or interleaved_1f1b, or remove it"
        )
    if layout.pp == 1:
        return
    if s.pp_stages_per_rank < 1:
        _fail(f"strategy.pp_stages_per_rank={s.pp_stages_per_rank} must be >= 1")
    multi = name in MULTI_STAGE_SCHEDULES or any(k in name for k in ("Interleaved", "Looped", "ZBV", "DualPipe"))
    if multi and s.pp_stages_per_rank < 2:
        _fail(f"strategy.pp_schedule={name} runs several stages per rank: set strategy.pp_stages_per_rank=2 (or more)")
    # V-shaped schedules (ZBV, DualPipeV) place exactly two stages per rank.
    if (name == "zbv" or name.endswith(("ZBVZeroBubble", "DualPipeV"))) and s.pp_stages_per_rank != 2:
        _fail(f"strategy.pp_schedule={name} places exactly 2 stages per rank in a V: set strategy.pp_stages_per_rank=2")
    if not multi and s.pp_stages_per_rank != 1:
        _fail(
            f"strategy.pp_schedule={name} runs one stage per rank but strategy.pp_stages_per_rank="
            f"{s.pp_stages_per_rank}: use pp_schedule=interleaved_1f1b or pp_stages_per_rank=1"
        )
    stages = layout.pp * s.pp_stages_per_rank
    n_layers = cfg.model.n_layers
    if stages > n_layers:
        _fail(
            f"{stages} pipeline stages (strategy.pp={layout.pp} x pp_stages_per_rank={s.pp_stages_per_rank}) "
            f"exceed model.n_layers={n_layers}: lower strategy.pp"
        )
    if s.pp_layers_per_stage:
        split = list(s.pp_layers_per_stage)
        if len(split) != stages or sum(split) != n_layers or min(split) < 1:
            _fail(
                f"strategy.pp_layers_per_stage={split} must list {stages} positive counts summing to "
                f"model.n_layers={n_layers}"
            )
    split = pp_stage_layers(n_layers, stages, list(s.pp_layers_per_stage))
    if len(set(split)) > 1:
        notes.append(f"uneven pipeline split: layers per stage {split}")
    n_mb = pp_microbatches(cfg, layout)
    if n_mb < layout.pp:
        _fail(
            f"strategy.pp_microbatches={n_mb} is fewer than the {layout.pp} pipeline ranks: the pipeline "
            f"would idle; set strategy.pp_microbatches>={layout.pp}"
        )
    if cfg.training.micro_batch % n_mb:
        _fail(
            f"training.micro_batch={cfg.training.micro_batch} is not divisible by strategy.pp_microbatches="
            f"{n_mb}: each pipeline micro-batch needs a whole number of samples"
        )


def check_moe_tensor_parallel(cfg: Any, layout: Layout, notes: list[str]) -> None:
    """Tensor parallel splits an MoE model's attention only; its routers and experts stay whole, plain
    tensors beside the DTensors, which only FSDP (turning every parameter into a DTensor) lets the
    optimizer's multi-tensor kernels take together."""
    from dtlaunch.models.registry import routed_experts

    if layout.tp == 1 or not routed_experts(cfg.model):
        return
    if int(cfg.strategy.zero_stage) < 2 or layout.dp * layout.cp == 1:
        _fail(
            f"strategy.tp={layout.tp} with a mixture-of-experts model needs FSDP over 2+ data-parallel ranks "
            f"(zero_stage={cfg.strategy.zero_stage}, dp={layout.dp}): use strategy=fsdp_tp, or strategy.tp=1"
        )


def check_expert_parallel(cfg: Any, layout: Layout, notes: list[str]) -> None:
    """strategy.ep: a MoE model, FSDP, and a degree dividing both the experts and the shard ranks."""
    ep = layout.ep
    if ep == 1:
        return
    from dtlaunch.models.registry import routed_experts

    experts = routed_experts(cfg.model)
    if not experts:
        _fail(
            f"strategy.ep={ep} splits routed experts, but model.arch={cfg.model.arch} has none: use strategy.ep=1 "
            f"or a mixture-of-experts model"
        )
    if experts % ep:
        _fail(
            f"strategy.ep={ep} does not divide model.moe.num_experts={experts}: choose an ep that divides it "
            f"(each rank holds num_experts/ep experts)"
        )
    if int(cfg.strategy.zero_stage) < 2:
        _fail(
            f"strategy.ep={ep} needs FSDP for the parameters it does not split: set strategy.zero_stage=2 or 3 "
            f"(it is {cfg.strategy.zero_stage})"
        )
    if layout.cp > 1:
        _fail(
            f"strategy.ep={ep} with strategy.cp={layout.cp} is not supported yet: use expert parallel or "
            f"context parallel (strategy.ep=1 or strategy.cp=1)"
        )
    if layout.dp_shard % ep:
        _fail(
            f"strategy.ep={ep} does not divide the data-parallel shard ranks it is taken from "
            f"(strategy.dp_shard={layout.dp_shard}): choose an ep that divides it, or raise strategy.dp_shard"
        )


def check_batch(cfg: Any, layout: Layout, notes: list[str]) -> None:
    gb = global_batch(cfg, layout)
    per_step = cfg.training.micro_batch * layout.dp
    if gb % per_step:
        _fail(
            f"training.global_batch={gb} is not divisible by micro_batch x dp = {cfg.training.micro_batch} x "
            f"{layout.dp} = {per_step}: set training.global_batch to a multiple of {per_step}"
        )


def check_zero(cfg: Any, layout: Layout, notes: list[str]) -> None:
    z = cfg.strategy.zero_stage
    if z not in (0, 1, 2, 3):
        _fail(f"strategy.zero_stage={z} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3 (FSDP full shard)")
    if z == 0 and layout.tp > 1 and layout.dp > 1:
        _fail(
            f"strategy.zero_stage=0 (DDP) cannot combine with strategy.tp={layout.tp} over dp={layout.dp} ranks: "
            f"use strategy.zero_stage=2 or 3 (FSDP) for data x tensor parallel"
        )
    if z == 1 and (layout.tp > 1 or layout.dp_replicate > 1):
        _fail(
            f"strategy.zero_stage=1 shards the optimizer over plain DDP and cannot combine with "
            f"tp={layout.tp}/dp_replicate={layout.dp_replicate}: use strategy.zero_stage=2 or 3"
        )
    if z in (2, 3) and layout.shard == 1 and layout.dp_replicate > 1:
        notes.append("zero_stage with dp_shard=1 shards nothing: parameters are only replicated")


def check_precision(cfg: Any, notes: list[str]) -> None:
    p = cfg.precision
    if p.param_dtype not in DTYPES:
        _fail(f"precision.param_dtype='{p.param_dtype}' is unknown: use one of {', '.join(DTYPES)}")
    if p.reduce_dtype not in DTYPES:
        _fail(f"precision.reduce_dtype='{p.reduce_dtype}' is unknown: use one of {', '.join(DTYPES)}")
    if p.param_dtype == "fp16" and not p.loss_scaling:
        _fail("precision.param_dtype=fp16 needs loss scaling (gradients underflow): set precision.loss_scaling=true")
    check_float8(cfg)
    if cfg.hardware.name == "cpu" and "fp16" in (p.param_dtype, p.reduce_dtype) and cfg.cluster.kind == "local":
        notes.append("fp16 on CPU is slow and poorly supported; bf16 is the better choice there")


def check_float8(cfg: Any) -> None:
    p, hw = cfg.precision, cfg.hardware
    if p.float8 not in FLOAT8_RECIPES:
        _fail(f"precision.float8='{p.float8}' is unknown: use one of {', '.join(FLOAT8_RECIPES)}")
    emulate = bool(p.float8_emulate)
    if p.float8 == "none":
        if emulate:
            _fail(
                "precision.float8_emulate=true emulates float8 matmuls, but precision.float8=none: "
                "set precision.float8=tensorwise (or rowwise), or precision.float8_emulate=false"
            )
        return
    if not hw.float8 and not emulate:
        _fail(
            f"precision.float8={p.float8} needs float8 tensor cores, which hardware={hw.name} does not have: "
            "use a Hopper/Ada/Blackwell profile (e.g. hardware=h100_80gb) or precision.float8=none "
            "(precision.float8_emulate=true runs its numerics without them, for tests only: no speed-up)"
        )
    if p.param_dtype != "bf16":
        _fail(
            f"precision.float8={p.float8} computes the rest in bf16: set precision=bf16 (param_dtype is {p.param_dtype})"
        )
    if emulate and cfg.training.compile:
        # torchao's emulation is for eager runs (torchtitan refuses the pair too).
        _fail("precision.float8_emulate=true runs eagerly only: set training.compile=false")


def check_float8_tensor_parallel(cfg: Any, layout: Layout, notes: list[str]) -> None:
    hw, la = cfg.hardware, cfg.launch
    gloo = la.backend == "gloo" or (la.backend == "auto" and int(hw.gpus_per_node) == 0)
    if cfg.precision.float8 == "tensorwise" and layout.tp > 1 and cfg.strategy.sequence_parallel and gloo:
        # torchao's float8 TP styles all-gather float8 activations under sequence parallel; gloo has no float8.
        _fail(
            "precision.float8=tensorwise with strategy.sequence_parallel=true all-gathers float8 activations, "
            "which gloo cannot: set strategy.sequence_parallel=false (or precision.float8=rowwise)"
        )


def check_training(cfg: Any, notes: list[str]) -> None:
    t = cfg.training
    if t.activation_checkpointing not in AC_MODES:
        _fail(
            f"training.activation_checkpointing='{t.activation_checkpointing}' is unknown: use one of "
            f"{', '.join(AC_MODES)}"
        )
    check_ac_options(t)
    if t.seq_len > cfg.model.max_seq_len:
        _fail(
            f"training.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len} of "
            f"{cfg.model.name}: lower training.seq_len"
        )
    if cfg.optim.schedule not in ("cosine", "linear", "constant"):
        _fail(f"optim.schedule='{cfg.optim.schedule}' is unknown: use cosine, linear or constant")


def check_ac_options(t: Any) -> None:
    """The selective-AC knobs: a known policy, a positive layer stride, a budget in [0, 1] that needs compile."""
    if t.ac_policy not in AC_POLICIES:
        _fail(f"training.ac_policy='{t.ac_policy}' is unknown: use one of {', '.join(AC_POLICIES)}")
    budget = float(t.ac_memory_budget)  # its range [0, 1] and ac_every_n_layers >= 1: config.ranges
    if budget > 0 and not t.compile:
        _fail(
            f"training.ac_memory_budget={budget:g} is applied by torch.compile's partitioner: set "
            "training.compile=true, or use training.ac_policy=op|layer without a budget"
        )
    if budget > 0 and t.activation_checkpointing != "selective":
        _fail(
            f"training.ac_memory_budget={budget:g} is a selective mode: set "
            f"training.activation_checkpointing=selective (it is '{t.activation_checkpointing}')"
        )


def check_checkpoint(cfg: Any, notes: list[str]) -> None:
    c = cfg.checkpoint
    if c.every_steps <= 0:
        _fail(f"checkpoint.every_steps={c.every_steps} must be > 0 (use checkpoint=none to turn saving off)")
    if c.keep_last < 1:
        _fail(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    if c.load_path and not os.path.isdir(c.load_path):
        _fail(f"checkpoint.load_path='{c.load_path}' is not a directory: give a checkpoints/step-* directory")


def _hub_dataset(d: Any, field: str = "path") -> bool:
    """data.kind=hf data.path=ORG/NAME (or data.val_path=ORG/NAME): a hub dataset, fetched by the launcher
    (dtlaunch.hub.dataset); its revision has a key of its own (data.revision, data.val_revision)."""
    from dtlaunch.hub.resolve import parse_hub_name

    value = str(getattr(d, field))
    ref = parse_hub_name(value) if d.kind == "hf" else None
    if ref is not None and ref.revision:
        rev = "revision" if field == "path" else "val_revision"
        _fail(f"data.{field}={value}: a hub dataset's revision goes in data.{rev}: data.{field}={ref.repo} "
              f"data.{rev}={ref.revision}")  # fmt: skip
    return ref is not None


def check_data(cfg: Any, notes: list[str]) -> None:
    d = cfg.data
    if d.kind != "synthetic":
        if not d.path:
            _fail(f"data.path is empty but data.kind={d.kind} reads files: set data.path=<dir, file or glob>")
        if not (os.path.exists(d.path) or glob.glob(d.path, recursive=True) or _hub_dataset(d)):
            _fail(f"data.path='{d.path}' does not exist: fix the path (tokens: run `dtlaunch data prepare` first)")
    problem = tokenizer_problem(cfg)
    if problem:
        _fail(problem)
    own = model_tokenizer_file(cfg.model.init_from, fetch=d.kind != "synthetic") if d.force_tokenizer else None
    if d.force_tokenizer and d.tokenizer == "byte" and own is not None:
        notes.append(f"data.force_tokenizer=true: training on byte ids, not those of {cfg.model.init_from}'s tokenizer")
    if d.tokenizer not in ("auto", "byte") and not os.path.isfile(d.tokenizer):
        _fail(f"data.tokenizer='{d.tokenizer}' is neither 'byte', 'auto' nor an existing tokenizer.json file")
    if effective_tokenizer(cfg) == "byte" and d.kind != "synthetic" and cfg.model.vocab_size < 258:
        _fail(
            f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer (258 ids): "
            f"use model.vocab_size>=258"
        )
    if d.kind in ("jsonl", "parquet", "hf"):
        _need_package({"jsonl": None, "parquet": "pyarrow", "hf": "datasets"}[d.kind], f"data.kind={d.kind}", "data")
    check_validation(cfg)
    check_format(cfg)
    if not d.pack and d.kind == "synthetic":
        _fail("data.pack=false needs documents, but data.kind=synthetic has none: drop it")
    if d.document_mask and d.kind == "synthetic":
        _fail("data.document_mask=true needs documents (EOS-separated), but data.kind=synthetic has none: drop it")
    if d.document_mask and cfg.strategy.pp > 1:
        _fail(
            f"data.document_mask=true is not supported with pipeline parallel (strategy.pp={cfg.strategy.pp}): "
            f"stages pass only hidden states; use strategy.pp=1 or data.document_mask=false"
        )


def check_format(cfg: Any) -> None:
    from dtlaunch.data.chat_templates import chat_template_problem

    d = cfg.data
    problem = chat_template_problem(str(d.chat_template), str(d.format))
    if problem:
        _fail(problem)
    if d.format == "text":
        return
    if d.kind not in ("jsonl", "parquet", "hf"):
        _fail(f"data.format={d.format} reads records: use data.kind=jsonl, parquet or hf (not {d.kind})")
    if effective_tokenizer(cfg) == "byte":
        _fail(
            f"data.format={d.format} needs a Hugging Face tokenizer (its chat template and special tokens): use "
            f"model.init_from=hf:DIR (its tokenizer) or set data.tokenizer to the path of a tokenizer.json"
        )
    # Preference pairs are scored per pipeline micro-batch by the objective (no per-token weight to carry).
    if cfg.strategy.pp > 1 and str(cfg.objective.name) == "sft":
        _fail(
            f"data.format={d.format} (loss on assistant / completion tokens only) is not supported with pipeline "
            f"parallel (strategy.pp={cfg.strategy.pp}) yet: use data.format=text or strategy.pp=1"
        )
    _need_package("transformers", f"data.format={d.format}", "data")


def _need_package(module: Any, what: str, extra: str) -> None:
    """An optional library a setting needs is a validate-time error naming the extra, not a worker crash."""
    import importlib.util

    if module and importlib.util.find_spec(module) is None:
        _fail(f"{what} needs the '{module}' package: pip install 'dtlaunch[{extra}]'")


def check_validation(cfg: Any) -> None:
    d, t = cfg.data, cfg.training
    if not 0.0 <= d.val_fraction < 1.0:
        _fail(f"data.val_fraction={d.val_fraction} must be in [0, 1): e.g. data.val_fraction=0.05")
    if d.val_path and d.val_fraction > 0:
        _fail(f"data.val_path='{d.val_path}' and data.val_fraction={d.val_fraction} both set: use one of them")
    if d.val_path and d.kind == "synthetic":
        _fail("data.val_path is set but data.kind=synthetic has no files: drop data.val_path")
    if d.val_path and not (
        os.path.exists(d.val_path) or glob.glob(d.val_path, recursive=True) or _hub_dataset(d, "val_path")
    ):
        _fail(f"data.val_path='{d.val_path}' does not exist: fix the path (or data.kind=hf for a hub dataset)")
    if t.eval_every < 0 or t.eval_batches < 1:
        _fail(
            f"training.eval_every={t.eval_every} / training.eval_batches={t.eval_batches}: eval_every must be "
            f">= 0 (0 = no evaluation) and eval_batches >= 1"
        )
    if t.eval_every > 0 and d.kind != "synthetic" and not (d.val_path or d.val_fraction > 0):
        _fail(
            f"training.eval_every={t.eval_every} needs validation data: set data.val_path=<path> or "
            f"data.val_fraction=0.05"
        )


def check_logging(cfg: Any, notes: list[str]) -> None:
    for tracker in cfg.logging.trackers:
        name = str(tracker)
        _need_package(
            {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name],
            f"logging.trackers includes {name}, which",
            name,
        )
    if cfg.logging.wandb.mode not in ("offline", "online", "disabled"):
        _fail(f"logging.wandb.mode='{cfg.logging.wandb.mode}' is unknown: use offline, online or disabled")


def check_hardware(cfg: Any, notes: list[str]) -> None:
    if cfg.hardware.memory_gib <= 0:
        _fail(f"hardware.memory_gib={cfg.hardware.memory_gib} must be > 0: pick a profile, e.g. hardware=h100_80gb")


def check_launch(cfg: Any, notes: list[str]) -> None:
    la = cfg.launch
    if la.backend not in ("auto", "gloo", "nccl"):
        _fail(f"launch.backend='{la.backend}' is unknown: use auto, gloo or nccl")
    if la.nnodes > 1 and not la.rdzv_endpoint and cfg.cluster.kind == "local":
        _fail(f"launch.nnodes={la.nnodes} needs a rendezvous: set launch.rdzv_endpoint=HOST:PORT (the first node)")
    if la.timeout_s <= 0:
        _fail(f"launch.timeout_s={la.timeout_s} must be > 0")
    if cfg.cluster.kind not in ("local", "slurm", "kubernetes", "skypilot"):
        _fail(f"cluster.kind='{cfg.cluster.kind}' is unknown: use cluster=local, slurm, kubernetes or skypilot")
    if cfg.debug.fail_mode not in ("raise", "sigkill", "input"):  # fault injection: how the rank fails
        _fail(f"debug.fail_mode='{cfg.debug.fail_mode}' is unknown: use raise, sigkill or input")


# Slurm's time limit formats (sbatch --time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
SLURM_TIME = re.compile(r"(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE)", re.IGNORECASE)


def check_cluster(cfg: Any, notes: list[str]) -> None:
    # sbatch would refuse a malformed limit only after the run directory exists, and for the evaluation
    # job only after the training job was already submitted: refuse it here.
    if cfg.cluster.kind != "slurm":
        return
    for key in ("time", "eval_time"):
        value = str(getattr(cfg.cluster, key))
        if value and not SLURM_TIME.fullmatch(value):
            _fail(
                f"cluster.{key}={value!r} is not a Slurm time limit: write HH:MM:SS or D-HH:MM:SS "
                f"(e.g. cluster.{key}=02:00:00), or '' for the partition's default"
            )


def check_profiling(cfg: Any, notes: list[str]) -> None:
    pr, steps = cfg.profiling, int(cfg.training.steps)
    if not pr.enabled:
        return
    if not any(1 <= int(s) <= steps for s in pr.steps) and not 0 < pr.every <= steps:
        _fail(
            f"profiling.steps={list(pr.steps)} / profiling.every={pr.every} profile no step of "
            f"training.steps={steps}: list steps in 1..{steps}, e.g. profiling.steps=[{min(3, steps)}]"
        )


def check_run_name(cfg: Any, notes: list[str]) -> None:
    # run.name names a directory under run.root ('group/name' is fine): an absolute name or a '..' part
    # would put the run, and every file it writes, outside run.root.
    name = str(cfg.run.name)
    if name.startswith(("/", os.sep)) or ".." in name.replace(os.sep, "/").split("/") or "\0" in name:
        _fail(
            f"run.name={name!r} would put the run outside run.root: use a relative name without '..' "
            f"(or set run.dir=<path> for a directory elsewhere)"
        )


SIMPLE_RULES: list[Callable[[Any, list[str]], None]] = [
    # The numeric ranges (one table next to the schema, config/ranges.py) first: the rules below may
    # divide by or index with these values.
    check_ranges,
    check_model_shape,
    check_precision,
    check_training,
    check_checkpoint,
    check_data,
    check_logging,
    check_hardware,
    check_launch,
    check_cluster,
    check_profiling,
    check_run_name,
    check_peft,
    check_objective,
]
LAYOUT_RULES: list[Callable[[Any, Layout, list[str]], None]] = [
    check_zero,
    check_moe_tensor_parallel,
    check_tensor_parallel,
    check_context_parallel,
    check_pipeline,
    check_expert_parallel,
    check_batch,
    check_float8_tensor_parallel,
    check_qlora,
    check_offload,
    check_mlp_tiles,
    check_optim,
]


def validate(cfg: Any) -> Validated:
    """Run every rule; the first violation raises ConfigError (exit 2)."""
    notes: list[str] = []
    for rule in SIMPLE_RULES:
        rule(cfg, notes)
    layout = check_layout(cfg, notes)
    for layout_rule in LAYOUT_RULES:
        layout_rule(cfg, layout, notes)
    return Validated(layout=layout, notes=notes)
