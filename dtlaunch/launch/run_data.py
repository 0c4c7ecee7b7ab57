"""Run data, prepared once by the launcher before any worker starts: text and record sources tokenized
(into the run directory or the content-addressed token cache), the tokenizer copied into the run, and
the sizes checked, so bad data fails with exit 2 instead of as a worker failure minutes in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.data.sources import (
    RECORD_KINDS,
    RUN_DATA_DIR,
    RUN_VAL_DIR,
    SOURCES_FILE,
    SampleSource,
    check_kind,
    data_sources,
)
from dtlaunch.data.tokenizer import check_vocab, load_tokenizer
from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import TOKENIZER_DIR, tokenizer_file

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def _text_source_id(cfg: JobConfig, path: str) -> dict[str, Any]:
    return {
        "path": path,
        "pattern": str(cfg.data.pattern),
        "tokenizer": str(cfg.data.tokenizer),
        "max_bytes": int(cfg.data.max_bytes),
    }


def _prepare_text(cfg: JobConfig, path: str, out: Path) -> Optional[Any]:
    """data.kind=text: tokenize into the run directory (skipped when already there from the same source)."""
    from dtlaunch.data.prepare import prepare_corpus

    ident = _text_source_id(cfg, path)
    meta_file = out / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("source") == ident:
        return None
    tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
    check_vocab(int(cfg.model.vocab_size), tok.vocab_size, f"data.tokenizer='{cfg.data.tokenizer}'")
    return prepare_corpus(
        [path],
        out,
        tok,
        pattern=str(cfg.data.pattern),
        max_bytes=int(cfg.data.max_bytes),
        key="data.path",
        extra_meta={"source": ident},
    )


def split_of(cfg: JobConfig, key: str = "data.path") -> str:
    """The split an hf source reads: data.split, or for data.val_path data.val_split when set."""
    if key == "data.val_path" and str(getattr(cfg.data, "val_split", "")):
        return str(cfg.data.val_split)
    return str(cfg.data.split)


def record_options(cfg: JobConfig, key: str = "data.path") -> dict[str, Any]:
    """What, besides the files and the tokenizer, decides a record source's tokens (part of the cache key)."""
    kind = str(cfg.data.kind)
    return {
        "kind": kind,
        "format": str(cfg.data.format),
        "fields": record_fields(cfg),
        "split": split_of(cfg, key) if kind == "hf" else "",
        # A hub dataset's configuration decides which records are read (absent, so local keys stay the same).
        **({"subset": str(cfg.data.subset)} if kind == "hf" and str(cfg.data.subset) else {}),
        **_chat_template_id(cfg),
        # How records become targets (docs/sft-data.md): v2 trains the completion's EOS and an assistant turn's
        # content and end of turn (not its generation-prompt header), or a template's {% generation %} blocks.
        **({"targets": 2} if str(cfg.data.format) in ("chat", "prompt_completion") else {}),
    }


def _chat_template_id(cfg: JobConfig) -> dict[str, str]:
    """For chat records, how they were encoded and data.chat_template's text decide the tokens too."""
    from dtlaunch.data.chat_templates import template_identity

    if str(cfg.data.format) not in ("chat", "preference", "unpaired"):
        return {}
    # "encoding": chat records are tokenized as one rendering (earlier entries, turn by turn, are not reused).
    spec = str(cfg.data.chat_template)
    return {"encoding": "whole", **({"chat_template": template_identity(spec)} if spec else {})}


def record_fields(cfg: JobConfig) -> list[str]:
    """The record fields data.format reads."""
    fmt = str(cfg.data.format)
    if fmt == "chat":
        return [str(cfg.data.messages_field)]
    if fmt == "prompt_completion":
        return [str(cfg.data.prompt_field), str(cfg.data.completion_field)]
    if fmt == "preference":
        margin = [str(cfg.data.margin_field)] if str(cfg.data.margin_field) else []  # objective=reward
        return [str(cfg.data.prompt_field), str(cfg.data.chosen_field), str(cfg.data.rejected_field), *margin]
    if fmt == "unpaired":
        return [str(cfg.data.prompt_field), str(cfg.data.completion_field), str(cfg.data.label_field)]
    return [str(cfg.data.text_field)]


def encoded_batches(cfg: JobConfig, tok: Any, path: str, key: str, subset: Optional[str] = None) -> Any:
    """The source's documents, encoded lazily in batches (see dtlaunch.data.cache.write_tokens)."""
    from dtlaunch.data.cache import encode_batches
    from dtlaunch.data.records import iter_documents, iter_records

    kind, fmt, split = str(cfg.data.kind), str(cfg.data.format), split_of(cfg, key)
    if fmt == "text":
        return encode_batches(tok, iter_documents(kind, path, str(cfg.data.text_field), split, key, subset))
    from dtlaunch.data.chat import ChatEncoder, encode_records

    encoder = ChatEncoder(Path(tok.name), tok._dtype, str(cfg.data.chat_template), chat=fmt == "chat")
    return encode_records(encoder, fmt, iter_records(kind, path, record_fields(cfg), split, key, subset), key)


def tokenize_records(cfg: JobConfig, path: str, key: str, tok: Any = None) -> Path:
    """A jsonl / parquet / hf source tokenized into the content-addressed cache; returns the entry."""
    from dtlaunch.data.cache import cache_root, cached_tokens
    from dtlaunch.data.records import source_files

    kind = str(cfg.data.kind)
    if tok is None:
        tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
    check_vocab(int(cfg.model.vocab_size), tok.vocab_size, f"data.tokenizer='{cfg.data.tokenizer}'")
    from dtlaunch.hub.dataset import local_source

    local, subset = local_source(cfg, path, key)  # a hub dataset: its pinned snapshot in the hub cache
    files = source_files(kind, local, key)
    if str(cfg.data.format) in ("preference", "unpaired"):
        return _tokenize_pairs(cfg, local, key, tok, files)
    fmt = str(cfg.data.format)
    batches = encoded_batches(cfg, tok, local, key, subset)
    root = cache_root(str(cfg.data.cache_dir))
    options = record_options(cfg, key)
    eos_target = fmt == "prompt_completion"
    entry, _ = cached_tokens(root, files, batches, tok, options, path, key, masked=fmt != "text", eos_target=eos_target)
    return entry


def _report_targets(entry: Path, cfg: JobConfig, key: str) -> None:
    """The run's first lines say what is trained: records, target tokens, records without any."""
    from dtlaunch.run.phases import phase

    meta = json.loads((entry / "meta.json").read_text())
    if "targets" not in meta:
        return
    fmt, docs, targets = str(cfg.data.format), int(meta["documents"]), int(meta["targets"])
    what = "each completion and its EOS" if fmt == "prompt_completion" else "assistant turns and their end of turn"
    none = int(meta["documents_without_targets"])
    phase(
        f"{key}: {docs} {fmt} records, {targets} target tokens ({targets / max(docs, 1):.1f} per record: {what})"
        + (f"; {none} records have none and train nothing" if none else "")
    )


def _tokenize_pairs(cfg: JobConfig, path: str, key: str, tok: Any, files: list) -> Path:
    """data.format=preference: pairs into their own cache entry (dtlaunch.data.preference); unpaired: each
    example and its KL row, as a pair (dtlaunch.data.unpaired)."""
    from dtlaunch.data.chat import ChatEncoder
    from dtlaunch.data.preference import PairEncoder, cached_pairs
    from dtlaunch.data.records import iter_records

    kind, split = str(cfg.data.kind), split_of(cfg, key)
    encoder = PairEncoder(ChatEncoder(Path(tok.name), tok._dtype, str(cfg.data.chat_template), chat=False), tok.eos_id)
    records = iter_records(kind, path, record_fields(cfg), split, key)
    if str(cfg.data.format) == "unpaired":
        from dtlaunch.data.unpaired import cached_examples

        run = int(cfg.training.micro_batch)  # the KL rows' run: TRL's per_device_train_batch_size
        options = {**record_options(cfg, key), "kl_run": run}
        return cached_examples(files, records, encoder, tok, options, str(cfg.data.cache_dir), key, run)
    return cached_pairs(files, records, encoder, tok, record_options(cfg, key), str(cfg.data.cache_dir), key)


def _report_cut_pairs(source: Any, cfg: JobConfig) -> None:
    """How many pairs training sees cut to training.seq_len + 1 tokens (the prompt's start goes first)."""
    from dtlaunch.data.preference import PairSource
    from dtlaunch.run.phases import phase

    if isinstance(source, PairSource):
        cut = source.cut_pairs()
        if cut:
            phase(
                f"{cut} of {source.num_samples} preference pairs are longer than training.seq_len+1="
                f"{int(cfg.training.seq_len) + 1} tokens and are cut (prompt start first, then completion end)"
            )


def prepare_run_data(cfg: JobConfig, run_dir: Path) -> Optional[Any]:
    """Called once by the launcher before workers start: tokenizes data.kind=text into run_dir/data and
    record kinds (jsonl / parquet / hf) into the token cache, checks data.kind=tokens shards and that
    train and validation data each hold a global batch, so bad data fails (exit 2) before any worker.
    Returns data.kind=text's PrepareSummary when it tokenized now, else None."""
    kind = check_kind(cfg)
    from dtlaunch.job.rules.grpo import grpo_data_problem

    problem = grpo_data_problem(cfg)
    if problem:
        raise InputError(problem)
    summary = None
    val_path = str(cfg.data.val_path)
    keep_tokenizer(cfg, Path(run_dir))
    if str(cfg.data.format) == "prompt":  # objective=grpo: prompts only, the completions are generated
        _prepare_prompts(cfg, Path(run_dir))
        return None
    if kind in RECORD_KINDS:
        tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
        sources = {"train": str(tokenize_records(cfg, str(cfg.data.path), "data.path", tok))}
        if val_path:
            sources["val"] = str(tokenize_records(cfg, val_path, "data.val_path", tok))
        _report_targets(Path(sources["train"]), cfg, "data.path")
        (Path(run_dir) / SOURCES_FILE).write_text(json.dumps(sources, indent=1) + "\n")
    elif kind == "text":
        summary = _prepare_text(cfg, str(cfg.data.path), Path(run_dir) / RUN_DATA_DIR)
        if val_path:
            _prepare_text(cfg, val_path, Path(run_dir) / RUN_VAL_DIR)
    if kind != "synthetic":
        from dtlaunch.config.decisions import Decisions

        gb = Decisions.of(cfg).global_batch
        if kind == "tokens":
            _check_shards_tokenizer(cfg, run_dir)
        train, val = data_sources(cfg, run_dir)
        _report_cut_pairs(train, cfg)
        _check_enough(train, gb, "data.path", cfg)
        if val is not None:
            _check_enough(val, gb, "data.val_path" if val_path else "data.val_fraction", cfg)
    return summary


def _prepare_prompts(cfg: JobConfig, run_dir: Path) -> None:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.data.prompts import prepare_prompts
    from dtlaunch.data.tokenizer import resolve_tokenizer_spec

    tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
    check_vocab(int(cfg.model.vocab_size), tok.vocab_size, f"data.tokenizer='{cfg.data.tokenizer}'")
    spec = Path(resolve_tokenizer_spec(str(cfg.data.tokenizer), str(cfg.model.init_from))).expanduser()
    gb = Decisions.of(cfg).global_batch
    prepare_prompts(
        cfg,
        run_dir,
        tokenizer_file(spec),
        tok.eos_id,
        gb // int(cfg.objective.num_generations),
    )


def _check_shards_tokenizer(cfg: JobConfig, run_dir: Path) -> None:
    """data.kind=tokens shards made with the byte tokenizer, for a model with its own, are refused."""
    from dtlaunch.data.shards import open_shards
    from dtlaunch.data.sources import shard_dir
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.tokenizer_choice import shards_tokenizer_problem

    meta = open_shards(shard_dir(cfg, run_dir, "train"), "data.path").meta
    problem = shards_tokenizer_problem(cfg, str(meta.get("tokenizer", "")))
    if problem:
        raise ConfigError(problem)


def keep_tokenizer(cfg: JobConfig, run_dir: Path) -> None:
    """A Hugging Face tokenizer travels with the run (run_dir/tokenizer), so that `ckpt export --format hf`
    can write it beside the weights and `generate RUN_DIR` decode with it, even if the original file moves
    or changes. Synthetic runs from hf:DIR keep the model's tokenizer too (their data.tokenizer is it)."""
    from dtlaunch.data.tokenizer import copy_tokenizer_files, resolve_tokenizer_spec

    spec = resolve_tokenizer_spec(str(cfg.data.tokenizer), str(cfg.model.init_from))
    if spec in ("", "byte"):
        return
    path = Path(spec).expanduser()
    out = run_dir / TOKENIZER_DIR
    copy_tokenizer_files(tokenizer_file(path), out)
    if str(cfg.data.chat_template) and str(cfg.data.format) in ("chat", "prompt"):
        from dtlaunch.data.chat_templates import load_chat_template
        from dtlaunch.data.tokenizer import set_chat_template

        # The template the run trained with goes with its tokenizer (and so into `ckpt export --format hf`).
        set_chat_template(out, load_chat_template(str(cfg.data.chat_template)))


def _check_enough(source: SampleSource, gb: int, key: str, cfg: JobConfig) -> None:
    n = source.num_samples
    if n is not None and n < gb:
        value = (
            cfg.data.val_path
            if key == "data.val_path"
            else (cfg.data.val_fraction if key != "data.path" else cfg.data.path)
        )
        raise InputError(
            f"{key}={value}: {n} full windows of {int(cfg.training.seq_len) + 1} tokens but one global batch needs "
            f"{gb}: add data, or lower training.seq_len / training.global_batch / training.micro_batch"
            + (" or raise data.val_fraction" if key == "data.val_fraction" else "")
        )
