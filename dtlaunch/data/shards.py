"""Token shards on disk: `shard-NNNNN.bin` files of raw uint16/uint32 ids plus one `meta.json`.

The format is deliberately plain (np.tofile): any tool can write it, and readers memory-map it, so a
corpus larger than RAM costs only page cache. `meta.json` is written last (atomically), so its
presence marks a complete directory.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from dtlaunch.errors import InputError

META_NAME = "meta.json"
FORMAT = "dtlaunch-tokens"


def shard_name(i: int, prefix: str = "shard") -> str:
    return f"{prefix}-{i:05d}.bin"


class ShardWriter:
    """Appends token arrays and cuts them into shards of `shard_tokens` ids."""

    def __init__(self, out_dir: Path, dtype: np.dtype, shard_tokens: int, prefix: str = "shard") -> None:
        if shard_tokens < 1:
            raise InputError(f"--shard-tokens must be at least 1, got {shard_tokens}")
        self.out_dir, self.dtype, self.shard_tokens = out_dir, np.dtype(dtype), shard_tokens
        self.prefix = prefix  # "mask": loss masks beside the token shards, cut at the same offsets
        self.shards: list[dict[str, Any]] = []
        self._buf: list[np.ndarray] = []
        self._buffered = 0
        out_dir.mkdir(parents=True, exist_ok=True)
        # A re-prepare must not leave a previous run's extra shards (or its meta) behind.
        for stale in [out_dir / META_NAME, *out_dir.glob(f"{prefix}-*.bin")]:
            stale.unlink(missing_ok=True)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._buffered

    def add(self, ids: np.ndarray) -> None:
        self._buf.append(ids.astype(self.dtype, copy=False))
        self._buffered += len(ids)
        while self._buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        data = np.concatenate(self._buf) if len(self._buf) != 1 else self._buf[0]
        name = shard_name(len(self.shards), self.prefix)
        data[:n].tofile(self.out_dir / name)
        self.shards.append({"file": name, "tokens": int(n)})
        rest = data[n:]
        self._buf, self._buffered = ([rest] if len(rest) else []), len(rest)

    def flush_rest(self) -> None:
        """Write the buffered tail as the last shard (a writer whose shards another writer's meta lists)."""
        if self._buffered:
            self._flush(self._buffered)

    def close(self, meta: dict[str, Any]) -> dict[str, Any]:
        if self._buffered:
            self._flush(self._buffered)
        full = {
            "format": FORMAT,
            "version": 1,
            "dtype": self.dtype.name,
            **meta,
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }
        tmp = self.out_dir / (META_NAME + ".tmp")
        tmp.write_text(json.dumps(full, indent=1) + "\n")
        os.replace(tmp, self.out_dir / META_NAME)
        return full


def read_meta(meta_path: Path, key: str) -> dict[str, Any]:
    try:
        meta = json.loads(meta_path.read_text())
        np.dtype(meta["dtype"])
        int(meta["vocab_size"])
        [(str(s["file"]), int(s["tokens"])) for s in meta["shards"]]
    except FileNotFoundError as exc:
        raise InputError(
            f"{key}: no {META_NAME} in '{meta_path.parent}': prepare the shards with `dtlaunch data prepare`"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"{key}: '{meta_path}' is not a valid token-shard meta file ({exc}); re-run `dtlaunch data prepare`"
        ) from exc
    return meta


@dataclass
class TokenShards:
    """The concatenation of memory-mapped shards, read as one long token array."""

    files: list[Path]
    meta: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # global offset of each shard
    total: int = 0

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) as int64, across shard boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        i = bisect.bisect_right(self.starts, start) - 1
        done = 0
        while done < length:
            arr, off = self.arrays[i], start + done - self.starts[i]
            take = min(length - done, len(arr) - off)
            out[done : done + take] = arr[off : off + take]
            done += take
            i += 1
        return out


def _shard_files(path: str, key: str) -> tuple[list[Path], Path]:
    """(shard files in order, meta.json path) for a directory, a single .bin file or a glob."""
    p = Path(path).expanduser()
    if p.is_dir():
        meta = read_meta(p / META_NAME, key)
        return [p / s["file"] for s in meta["shards"]], p / META_NAME
    if p.is_file():
        return [p], p.parent / META_NAME
    matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if m.endswith(".bin"))
    if not matches:
        raise InputError(
            f"{key}='{path}' does not exist (no directory, file or matching .bin shards): "
            f"fix the path or prepare the data with `dtlaunch data prepare`"
        )
    return matches, matches[0].parent / META_NAME


def open_shards(path: str, key: str = "data.path") -> TokenShards:
    """Memory-map every shard; a missing or truncated shard is a one-line InputError."""
    files, meta_path = _shard_files(path, key)
    meta = read_meta(meta_path, key)
    dtype = np.dtype(meta["dtype"])
    expected = {s["file"]: int(s["tokens"]) for s in meta.get("shards", [])}
    ts = TokenShards(files=files, meta=meta)
    for f in files:
        try:
            size = f.stat().st_size
        except FileNotFoundError as exc:
            raise InputError(f"{key}: shard '{f}' is missing: re-run `dtlaunch data prepare`") from exc
        want = expected.get(f.name)
        if size % dtype.itemsize or (want is not None and size != want * dtype.itemsize):
            raise InputError(
                f"{key}: shard '{f}' is corrupt ({size} bytes, expected "
                f"{'a multiple of ' + str(dtype.itemsize) if want is None else want * dtype.itemsize}): "
                f"re-run `dtlaunch data prepare`"
            )
        if size == 0:
            continue
        ts.starts.append(ts.total)
        ts.arrays.append(np.memmap(f, dtype=dtype, mode="r"))
        ts.total += size // dtype.itemsize
    return ts


def open_masks(path: str, key: str = "data.path") -> Optional[TokenShards]:
    """The loss-mask shards (uint8, 1 = a training target) listed by a prepared directory's meta.json, or
    None when its data has no mask (plain text: every token is a target)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    meta = read_meta(p / META_NAME, key)
    if not meta.get("masks"):
        return None
    ts = TokenShards(files=[p / s["file"] for s in meta["masks"]], meta=meta)
    for f in ts.files:
        size = f.stat().st_size if f.is_file() else -1
        if size < 0:
            raise InputError(f"{key}: mask shard '{f}' is missing: re-prepare the data")
        if size:
            ts.starts.append(ts.total)
            ts.arrays.append(np.memmap(f, dtype=np.uint8, mode="r"))
            ts.total += size
    return ts
