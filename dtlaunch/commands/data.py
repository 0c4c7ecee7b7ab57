"""`data prepare`: tokenize text files, JSONL, Parquet or a Hugging Face dataset into token shards that a
`data.kind=tokens` run reads."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dtlaunch.commands.common import console


def prepare_command(
    inputs: Sequence[str],
    out: str,
    tokenizer: str,
    shard_tokens: int,
    pattern: str,
    max_bytes: int,
    kind: str = "text",
    text_field: str = "text",
    split: str = "train",
) -> int:
    from dtlaunch.data.prepare import prepare_corpus
    from dtlaunch.data.tokenizer import load_tokenizer
    from dtlaunch.errors import InputError

    if not inputs:
        raise InputError("data prepare needs at least one INPUT: a directory, a text file or a glob")
    if not out.strip():
        raise InputError("--out is empty: give the directory to write the shards into")
    if max_bytes < 0:
        raise InputError(f"--max-bytes must be 0 (no cap) or positive, got {max_bytes}")
    tok = load_tokenizer(tokenizer)
    if kind != "text":
        return _prepare_records(inputs, Path(out), tok, kind, text_field, split, shard_tokens)
    s = prepare_corpus(inputs, Path(out), tok, pattern=pattern, shard_tokens=shard_tokens, max_bytes=max_bytes)
    console().print(
        f"prepared {s.files:,} files ({s.bytes_read:,} bytes) -> {s.tokens:,} tokens in {s.shards} shard(s) "
        f"of {s.dtype} under {s.out_dir} (tokenizer {tok.name}, vocab {s.vocab_size:,}) in {s.seconds:.1f}s; "
        f"train on it with data.kind=tokens data.path={s.out_dir}",
        markup=False,
        soft_wrap=True,
    )
    return 0


def _prepare_records(
    inputs: Sequence[str], out: Path, tok: object, kind: str, text_field: str, split: str, shard_tokens: int
) -> int:
    import itertools
    import time

    from dtlaunch.data import cache
    from dtlaunch.data.records import iter_documents, source_files
    from dtlaunch.errors import InputError

    if kind not in ("jsonl", "parquet", "hf"):
        raise InputError(f"--kind '{kind}' is unknown: use text, jsonl, parquet or hf")
    t0 = time.perf_counter()
    files = [f for item in inputs for f in source_files(kind, item, "INPUT")]
    texts = itertools.chain.from_iterable(
        iter_documents(kind, item, text_field, split, "INPUT", field_key="--text-field") for item in inputs
    )
    batches = cache.encode_batches(tok, texts)  # type: ignore[arg-type]
    meta = cache.write_tokens(
        out,
        batches,
        tok,
        sum(f.stat().st_size for f in files),
        ", ".join(inputs),
        "INPUT",  # type: ignore[arg-type]
        {"source": {"kind": kind, "text_field": text_field, "inputs": list(inputs)}},
        shard_tokens,
    )
    console().print(
        f"prepared {meta['documents']:,} documents from {len(files):,} files -> {meta['tokens']:,} tokens in "
        f"{len(meta['shards'])} shard(s) of {meta['dtype']} under {out} (tokenizer {meta['tokenizer']}, vocab "
        f"{meta['vocab_size']:,}) in {time.perf_counter() - t0:.1f}s; train on it with data.kind=tokens data.path={out}",
        markup=False,
        soft_wrap=True,
    )
    return 0
