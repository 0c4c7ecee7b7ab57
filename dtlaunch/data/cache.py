"""Content-addressed cache of tokenized datasets: tokenize once, memory-map on every later start.

An entry is a directory of token shards in the `data prepare` format (shard-NNNNN.bin + meta.json)
named by a hash of what determines its contents: the input files' identity and a sample of their
bytes (path, size, mtime, first and last 64 KiB), the tokenizer file's bytes and the reading options.
meta.json carries a manifest (every shard's size and CRC-32); an entry whose shards do not match it is
deleted and rebuilt, never used. Entries are built under a temporary name and renamed into place, so
a crash mid-tokenization leaves no half entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from dtlaunch.data.shards import META_NAME, ShardWriter
from dtlaunch.data.tokenizer import Tokenizer, token_dtype
from dtlaunch.errors import InputError

CACHE_ENV = "DTLAUNCH_DATA_CACHE"
CACHE_VERSION = 1
SHARD_TOKENS = 50_000_000
_SAMPLE_BYTES = 65536
_BATCH_DOCS = 512


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dtlaunch" / "tokens").expanduser()


def check_writable(root: Path, key: str = "data.cache_dir") -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(
            f"{key}='{root}' is not writable ({exc.strerror}): set data.cache_dir (or ${CACHE_ENV}) to a writable directory"
        ) from exc


def _file_identity(f: Path) -> list[Any]:
    st = f.stat()
    h = hashlib.sha256()
    with f.open("rb") as fh:
        h.update(fh.read(_SAMPLE_BYTES))
        if st.st_size > _SAMPLE_BYTES:
            fh.seek(max(_SAMPLE_BYTES, st.st_size - _SAMPLE_BYTES))
            h.update(fh.read(_SAMPLE_BYTES))
    return [str(f.resolve()), st.st_size, st.st_mtime_ns, h.hexdigest()]


def tokenizer_identity(tok: Tokenizer) -> str:
    """The tokenizer file's hash (a changed tokenizer.json is a new cache entry), or the built-in's name."""
    path = Path(tok.name)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return tok.name


def cache_key(files: Sequence[Path], tok: Tokenizer, options: dict[str, Any]) -> str:
    ident = {
        "version": CACHE_VERSION,
        "files": [_file_identity(f) for f in files],
        "tokenizer": tokenizer_identity(tok),
        "options": options,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_entry(entry: Path) -> Optional[dict[str, Any]]:
    """The entry's meta when every shard matches the manifest, else None (missing, partial or corrupt)."""
    try:
        meta = json.loads((entry / META_NAME).read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        for s, size in [(s, itemsize) for s in meta["shards"]] + [(s, 1) for s in meta.get("masks", [])]:
            f = entry / s["file"]
            if f.stat().st_size != int(s["tokens"]) * size or _crc32(f) != int(s["crc32"]):
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def encode_batches(tok: Tokenizer, texts: Iterable[str]) -> Iterator[tuple[list[np.ndarray], int]]:
    """(token arrays, characters read) per batch of documents; HF tokenizers encode a batch in parallel."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) >= _BATCH_DOCS:
            yield _encode(tok, batch), sum(len(t) for t in batch)
            batch = []
    if batch:
        yield _encode(tok, batch), sum(len(t) for t in batch)


def _encode(tok: Tokenizer, batch: list[str]) -> list[np.ndarray]:
    many = getattr(tok, "encode_many", None)
    if many is not None:
        return many(batch)
    return [tok.encode(t.encode("utf-8")) for t in batch]


class _Progress:
    """A rich bar on stderr when it is a terminal (the launcher's), silent otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self._bar: Any = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"[bold]tokenize[/] {label}"),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._bar.add_task("tokenize", total=total)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def write_tokens(
    out_dir: Path,
    batches: Iterable[tuple[list[Any], int]],
    tok: Tokenizer,
    total_bytes: int,
    label: str,
    key: str,
    extra_meta: dict,
    shard_tokens: int = SHARD_TOKENS,
    masked: bool = False,
    eos_target: bool = False,
) -> dict[str, Any]:
    """Write encoded documents (each followed by EOS) as shards + meta.json with the manifest in `out_dir`,
    streaming: only one batch of documents and one shard's buffer are in memory. `batches` yields
    (documents, characters read); a document is an id array, or with `masked` an (ids, loss mask) pair whose
    mask goes to parallel mask-NNNNN.bin files (uint8, 1 = the token is a training target). With `eos_target`
    (prompt/completion records) the EOS after a masked document is a target, as TRL's appended EOS is; else
    it only separates documents. Masked data records its target count in meta.json ("targets",
    "documents_without_targets") and is refused when no document has one."""
    t0 = time.perf_counter()
    writer = ShardWriter(out_dir, token_dtype(tok.vocab_size), shard_tokens)
    masks = ShardWriter(out_dir, np.dtype(np.uint8), shard_tokens, prefix="mask") if masked else None
    eos = np.asarray([tok.eos_id] if tok.eos_id is not None else [], dtype=writer.dtype)
    docs, chars, targets, untrained = 0, 0, 0, 0
    eos_mask = np.full(len(eos), int(eos_target), np.uint8)
    bar = _Progress(label, total_bytes)
    try:
        for documents, n_chars in batches:
            for doc in documents:
                ids, mask = doc if masked else (doc, None)
                if not len(ids):
                    continue
                writer.add(np.concatenate([ids.astype(writer.dtype, copy=False), eos]) if len(eos) else ids)
                if masks is not None:
                    doc_mask = np.concatenate([mask.astype(np.uint8), eos_mask])
                    masks.add(doc_mask)
                    # A document's first token is never a target: nothing before it predicts it.
                    n = int(doc_mask[1:].sum())
                    targets += n
                    untrained += n == 0
                docs += 1
            chars += n_chars
            bar.advance(n_chars)
    finally:
        bar.stop()
    if writer.tokens == 0:
        raise InputError(f"{key}: the dataset {label} is empty (0 tokens from {docs} documents): give it some text")
    if masks is not None and targets == 0:
        raise InputError(
            f"{key}: no record of {label} has a token to learn ({docs} records, every one context only): give "
            f"records with a non-empty completion or assistant turn"
        )
    if masks is not None:
        masks.flush_rest()
    writer.close({})  # flushes the last shard; the meta below, with the manifest, replaces this one
    for s in writer.shards:
        s["crc32"] = _crc32(out_dir / s["file"])
    extra: dict[str, Any] = {}
    if masks is not None:
        for s in masks.shards:
            s["crc32"] = _crc32(out_dir / s["file"])
        extra.update(masks=masks.shards, targets=targets, documents_without_targets=untrained)
    return writer.close(
        {
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "eos_id": tok.eos_id,
            "documents": docs,
            "characters": chars,
            "seconds": round(time.perf_counter() - t0, 3),
            **extra,
            **extra_meta,
        }
    )


def build_entry(
    entry: Path,
    batches: Iterable[tuple[list[Any], int]],
    tok: Tokenizer,
    total_bytes: int,
    label: str,
    key: str,
    extra_meta: dict,
    masked: bool = False,
    eos_target: bool = False,
) -> dict[str, Any]:
    """write_tokens into a temporary directory renamed to `entry` when complete."""
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        meta = write_tokens(
            tmp, batches, tok, total_bytes, label, key, extra_meta, masked=masked, eos_target=eos_target
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_entry(tmp, entry)
    return meta


def publish_entry(tmp: Path, entry: Path, complete: Optional[Callable[[Path], bool]] = None) -> None:
    """Move the finished `tmp` to `entry`. Every node of a multi-node job prepares its data into the same
    shared cache at once, so another launcher may have published this entry first -- and its workers, or
    its launcher's checks, may be reading it: a complete entry is never removed (ours is dropped), only a
    partial or corrupt one is moved aside and replaced."""
    try:
        os.rename(tmp, entry)  # fails while `entry` exists with files in it
        return
    except OSError:
        pass
    complete = complete or (lambda e: verify_entry(e) is not None)
    if complete(entry):  # another process finished the same entry first: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
        return
    stale = entry.with_name(f"{entry.name}.stale-{os.getpid()}")
    try:
        os.rename(entry, stale)
        os.rename(tmp, entry)
    except OSError:  # a third process replaced it in between: that one is complete
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(stale, ignore_errors=True)


def built_entry(
    cache_dir: str,
    files: Sequence[Path],
    tok: Any,
    options: dict,
    build: Callable[[Path], None],
    complete: Callable[[Path], bool],
) -> Path:
    """The cache entry keyed by these files, tokenizer and options: `build` fills a fresh temporary directory
    (unless a `complete` entry exists), which is then published (`publish_entry`); a failed build leaves
    nothing behind. For the record caches beside the token cache (preference pairs, unpaired examples)."""
    root = cache_root(cache_dir)
    check_writable(root)
    entry = root / cache_key(files, tok, options)
    if complete(entry):
        return entry
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_entry(tmp, entry, complete=complete)
    return entry


def cached_tokens(
    root: Path,
    files: Sequence[Path],
    batches: Iterable[tuple[list[Any], int]],
    tok: Tokenizer,
    options: dict[str, Any],
    label: str,
    key: str = "data.path",
    masked: bool = False,
    eos_target: bool = False,
) -> tuple[Path, bool]:
    """(entry directory, whether it was built now). `batches` (see write_tokens) is only consumed when building."""
    check_writable(root)
    entry = root / cache_key(files, tok, options)
    if verify_entry(entry) is not None:
        return entry, False
    total = sum(f.stat().st_size for f in files)
    build_entry(entry, batches, tok, total, label, key, {"source": options}, masked, eos_target)
    return entry, True
