"""data: where the text comes from, its format and the validation split."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.errors import ConfigError
from dtlaunch.job.rules import need_package
from dtlaunch.job.tokenizer_choice import effective_tokenizer, model_tokenizer_file, tokenizer_problem

if TYPE_CHECKING:
    from dtlaunch.config.schema import DataConfig, JobConfig


def _hub_dataset(d: DataConfig, field: str = "path") -> bool:
    """data.kind=hf data.path=ORG/NAME (or data.val_path=ORG/NAME): a hub dataset, fetched by the launcher
    (dtlaunch.hub.dataset); its revision has a key of its own (data.revision, data.val_revision)."""
    from dtlaunch.hub.resolve import parse_hub_name

    value = str(getattr(d, field))
    ref = parse_hub_name(value) if d.kind == "hf" else None
    if ref is not None and ref.revision:
        rev = "revision" if field == "path" else "val_revision"
        raise ConfigError(f"data.{field}={value}: a hub dataset's revision goes in data.{rev}: data.{field}={ref.repo} "
              f"data.{rev}={ref.revision}")  # fmt: skip
    return ref is not None


def check_data(cfg: JobConfig, notes: list[str]) -> None:
    d = cfg.data
    if d.kind != "synthetic":
        if not d.path:
            raise ConfigError(
                f"data.path is empty but data.kind={d.kind} reads files: set data.path=<dir, file or glob>"
            )
        if not (os.path.exists(d.path) or glob.glob(d.path, recursive=True) or _hub_dataset(d)):
            raise ConfigError(
                f"data.path='{d.path}' does not exist: fix the path (tokens: run `dtlaunch data prepare` first)"
            )
    problem = tokenizer_problem(cfg)
    if problem:
        raise ConfigError(problem)
    own = model_tokenizer_file(cfg.model.init_from, fetch=d.kind != "synthetic") if d.force_tokenizer else None
    if d.force_tokenizer and d.tokenizer == "byte" and own is not None:
        notes.append(f"data.force_tokenizer=true: training on byte ids, not those of {cfg.model.init_from}'s tokenizer")
    if d.tokenizer not in ("auto", "byte") and not os.path.isfile(d.tokenizer):
        raise ConfigError(
            f"data.tokenizer='{d.tokenizer}' is neither 'byte', 'auto' nor an existing tokenizer.json file"
        )
    if effective_tokenizer(cfg) == "byte" and d.kind != "synthetic" and cfg.model.vocab_size < 258:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer (258 ids): "
            f"use model.vocab_size>=258"
        )
    if d.kind in ("jsonl", "parquet", "hf"):
        need_package({"jsonl": None, "parquet": "pyarrow", "hf": "datasets"}[d.kind], f"data.kind={d.kind}", "data")
    check_validation(cfg)
    check_format(cfg)
    if not d.pack and d.kind == "synthetic":
        raise ConfigError("data.pack=false needs documents, but data.kind=synthetic has none: drop it")
    if d.document_mask and d.kind == "synthetic":
        raise ConfigError(
            "data.document_mask=true needs documents (EOS-separated), but data.kind=synthetic has none: drop it"
        )
    if d.document_mask and cfg.strategy.pp > 1:
        raise ConfigError(
            f"data.document_mask=true is not supported with pipeline parallel (strategy.pp={cfg.strategy.pp}): "
            f"stages pass only hidden states; use strategy.pp=1 or data.document_mask=false"
        )


def check_format(cfg: JobConfig) -> None:
    from dtlaunch.data.chat_templates import chat_template_problem

    d = cfg.data
    problem = chat_template_problem(str(d.chat_template), str(d.format))
    if problem:
        raise ConfigError(problem)
    if d.format == "text":
        return
    if d.kind not in ("jsonl", "parquet", "hf"):
        raise ConfigError(f"data.format={d.format} reads records: use data.kind=jsonl, parquet or hf (not {d.kind})")
    if effective_tokenizer(cfg) == "byte":
        raise ConfigError(
            f"data.format={d.format} needs a Hugging Face tokenizer (its chat template and special tokens): use "
            f"model.init_from=hf:DIR (its tokenizer) or set data.tokenizer to the path of a tokenizer.json"
        )
    # Preference pairs are scored per pipeline micro-batch by the objective (no per-token weight to carry).
    if cfg.strategy.pp > 1 and cfg.objective.name == ObjectiveName.sft:
        raise ConfigError(
            f"data.format={d.format} (loss on assistant / completion tokens only) is not supported with pipeline "
            f"parallel (strategy.pp={cfg.strategy.pp}) yet: use data.format=text or strategy.pp=1"
        )
    need_package("transformers", f"data.format={d.format}", "data")


def check_validation(cfg: JobConfig) -> None:
    d, t = cfg.data, cfg.training
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1): e.g. data.val_fraction=0.05")
    if d.val_path and d.val_fraction > 0:
        raise ConfigError(
            f"data.val_path='{d.val_path}' and data.val_fraction={d.val_fraction} both set: use one of them"
        )
    if d.val_path and d.kind == "synthetic":
        raise ConfigError("data.val_path is set but data.kind=synthetic has no files: drop data.val_path")
    if d.val_path and not (
        os.path.exists(d.val_path) or glob.glob(d.val_path, recursive=True) or _hub_dataset(d, "val_path")
    ):
        raise ConfigError(
            f"data.val_path='{d.val_path}' does not exist: fix the path (or data.kind=hf for a hub dataset)"
        )
    if t.eval_every < 0 or t.eval_batches < 1:
        raise ConfigError(
            f"training.eval_every={t.eval_every} / training.eval_batches={t.eval_batches}: eval_every must be "
            f">= 0 (0 = no evaluation) and eval_batches >= 1"
        )
    if t.eval_every > 0 and d.kind != "synthetic" and not (d.val_path or d.val_fraction > 0):
        raise ConfigError(
            f"training.eval_every={t.eval_every} needs validation data: set data.val_path=<path> or "
            f"data.val_fraction=0.05"
        )
