"""Tokenize text files into token shards: used by `dtlaunch data prepare` and by `data.kind=text` runs.

File order is deterministic (sorted paths), so the same inputs give byte-identical shards on every
machine and every run. Each file is one document, followed by the tokenizer's EOS id when it has one.
"""

from __future__ import annotations

import glob
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dtlaunch.data.shards import ShardWriter
from dtlaunch.data.tokenizer import Tokenizer, token_dtype
from dtlaunch.errors import InputError

DEFAULT_SHARD_TOKENS = 100_000_000
# Directory scans skip these: caches, VCS internals, and third-party packages installed inside a
# Python tree (so the stdlib corpus is the same on every machine whatever pip installed there).
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", ".hg", ".svn", "node_modules"}


@dataclass
class PrepareSummary:
    out_dir: Path
    files: int
    bytes_read: int
    tokens: int
    shards: int
    vocab_size: int
    dtype: str
    seconds: float


def resolve_inputs(inputs: Sequence[str], pattern: str, key: str = "INPUT") -> list[Path]:
    """Each input is a directory (searched with `pattern`), a file, or a glob; sorted, de-duplicated."""
    found: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            hits = [f for f in p.glob(pattern) if f.is_file() and not _SKIP_DIRS.intersection(f.relative_to(p).parts)]
            if not hits:
                raise InputError(
                    f"{key}: directory '{item}' has no files matching '{pattern}': "
                    f"fix the pattern (--pattern / data.pattern) or the path"
                )
        elif p.is_file():
            hits = [p]
        else:
            hits = [Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file()]
            if not hits:
                raise InputError(f"{key}: '{item}' does not exist: give a directory, a file or a glob of text files")
        found.extend(sorted(hits))
    seen: set[Path] = set()
    return [f for f in found if not (f in seen or seen.add(f))]


def refuse_json(path: Path, data: bytes, key: str) -> None:
    """Text mode trains on a file's raw bytes: a JSON / JSON Lines file would teach the model its braces and
    keys. Refused, naming the kind that reads its text field instead."""
    head = data[:4096].lstrip()
    looks = path.suffix.lower() in (".json", ".jsonl", ".ndjson") or head[:1] in (b"{", b"[")
    if not looks:
        return
    first = head.split(b"\n", 1)[0]
    try:
        json.loads(first)
    except ValueError:
        if path.suffix.lower() not in (".json", ".jsonl", ".ndjson"):
            return  # starts with a brace but is not JSON (e.g. code): plain text after all
    raise InputError(
        f"{key}: '{path}' looks like JSON, and text mode would train on its raw JSON: read its text field "
        f"with data.kind=jsonl data.text_field=FIELD (data prepare: --kind jsonl --text-field FIELD)"
    )


def prepare_corpus(
    inputs: Sequence[str],
    out_dir: Path,
    tokenizer: Tokenizer,
    pattern: str = "**/*",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_bytes: int = 0,
    key: str = "INPUT",
    extra_meta: dict[str, Any] | None = None,
) -> PrepareSummary:
    """Tokenize `inputs` into `out_dir`; `max_bytes` > 0 stops after that much text (last file cut)."""
    t0 = time.perf_counter()
    files = resolve_inputs(inputs, pattern, key)
    writer = ShardWriter(Path(out_dir), token_dtype(tokenizer.vocab_size), shard_tokens)
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    used, total_bytes = 0, 0
    for f in files:
        if max_bytes and total_bytes >= max_bytes:
            break
        try:
            data = f.read_bytes()
        except OSError as exc:
            raise InputError(f"{key}: cannot read '{f}': {exc.strerror}") from exc
        refuse_json(f, data, key)
        if max_bytes:
            data = data[: max_bytes - total_bytes]
        if not data:
            continue  # an empty file is no document: no lone EOS
        total_bytes += len(data)
        used += 1
        ids = tokenizer.encode(data)
        writer.add(np.concatenate([ids, np.asarray(eos, dtype=ids.dtype)]) if eos else ids)
    if writer.tokens == 0:
        # No meta.json is written, so the directory never passes for a prepared corpus.
        raise InputError(
            f"{key}: the corpus {list(inputs)} is empty (0 tokens from {used} files): point it at non-empty text files"
        )
    meta = writer.close(
        {
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name,
            "eos_id": tokenizer.eos_id,
            "files": used,
            "bytes": total_bytes,
            **(extra_meta or {}),
        }
    )
    return PrepareSummary(
        out_dir=Path(out_dir),
        files=used,
        bytes_read=total_bytes,
        tokens=meta["tokens"],
        shards=len(meta["shards"]),
        vocab_size=tokenizer.vocab_size,
        dtype=meta["dtype"],
        seconds=time.perf_counter() - t0,
    )
