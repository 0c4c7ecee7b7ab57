"""Training data as one global sample order: which tokens sample k holds, for every layout.

The order is defined for the whole job, not per rank: sample stream position k maps to sample
`perm_e[k % N]` where e = k // N is the epoch and perm_e a permutation seeded by (training.seed, e).
Micro-step j of optimizer step s on dp rank r reads stream positions
`s*gb + j*mb*dp + r*mb ... + mb`, which is simply "the next mb*dp positions, rank r takes slice r".
Hence DP(2) x mb 4 and one process x mb 8 see the same samples, TP/PP peers (same dp rank) see the
same batch, and the loader's state is one global number (samples consumed) that a checkpoint can
restore into any dp size. Epochs flow into each other without dropping a tail: every sample is seen
exactly once per epoch; a global batch may straddle two epochs.

Kinds: synthetic (uniform random ids, sample k generated from (seed, k): free and layout-independent),
tokens (memory-mapped shards, fixed windows of seq_len+1 tokens), text and record kinds (tokenized once
by the launcher, dtlaunch.launch.run_data, then read as tokens). Numpy only: the launcher checks sizes with
these before any worker starts; the worker's loader (dtlaunch.train.data) batches them into tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import numpy as np

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.data.shards import open_masks, open_shards
from dtlaunch.data.tokenizer import check_vocab
from dtlaunch.errors import ConfigError, InputError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

RECORD_KINDS = ("jsonl", "parquet", "hf")
RUN_DATA_DIR = "data"
RUN_VAL_DIR = "data-val"
# Where the launcher tells workers which token-cache entries hold a record kind's train / val data.
SOURCES_FILE = "data_sources.json"
# Distinct seed-sequence tags so sample contents, epoch orders, the held-out split and synthetic
# validation data never share a random stream.
TAG_SYNTHETIC, TAG_ORDER, TAG_SPLIT, TAG_SYNTHETIC_VAL = 0x5A17, 0x0D3E, 0x5B11, 0x7A15


class SampleSource(Protocol):
    num_samples: Optional[int]  # None = unbounded (synthetic)

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticSource:
    """Uniform random ids; sample k depends only on (seed, k), so any layout sees identical data."""

    num_samples: Optional[int] = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int, tag: int = TAG_SYNTHETIC) -> None:
        self.vocab_size, self.length, self.seed, self.tag = vocab_size, seq_len + 1, seed, tag

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.tag, index])
        return rng.integers(0, self.vocab_size, self.length, dtype=np.int64)


class TokenSource:
    """Sample i = tokens [i*seq_len, i*seq_len + seq_len + 1) of the concatenated shards (the last
    token of one window is the first of the next, so every token is a target exactly once)."""

    def __init__(self, path: str, seq_len: int, key: str) -> None:
        self.shards = open_shards(path, key)
        # Chat / prompt-completion data: 1 where a token is a training target (the rest are context only).
        self.masks = open_masks(path, key)
        self.seq_len = seq_len
        self.num_samples: Optional[int] = max(0, (self.shards.total - 1) // seq_len)

    def sample(self, index: int) -> np.ndarray:
        """(seq_len+1,) ids, or for masked data (2, seq_len+1): ids and the target mask."""
        ids = self.shards.window(index * self.seq_len, self.seq_len + 1)
        if self.masks is None:
            return ids
        return np.stack([ids, self.masks.window(index * self.seq_len, self.seq_len + 1)])


class DocumentSource:
    """Unpacked data (data.pack=false): sample i is document i alone (up to and including its EOS), cut at
    seq_len+1 tokens and padded with EOS; padding, and context-only tokens of masked data, are no targets.
    Samples are (2, seq_len+1): ids and the target mask (TokenLoader's masked path)."""

    def __init__(self, base: TokenSource, eos: int, seq_len: int) -> None:
        self.base, self.eos, self.length = base, eos, seq_len + 1
        # One scan of the memory-mapped shards for the document boundaries (the EOS positions).
        ends, offset = [], 0
        for arr in base.shards.arrays:
            ends.append(np.flatnonzero(arr == eos) + offset + 1)
            offset += len(arr)
        self.ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
        if not len(self.ends) or self.ends[-1] != base.shards.total:
            self.ends = np.append(self.ends, base.shards.total)  # a last document without EOS
        self.starts = np.concatenate([[0], self.ends[:-1]])
        self.num_samples: Optional[int] = len(self.ends)

    def sample(self, index: int) -> np.ndarray:
        start = int(self.starts[index])
        n = min(int(self.ends[index]) - start, self.length)
        out = np.zeros((2, self.length), dtype=np.int64)
        out[0] = self.eos
        out[0, :n] = self.base.shards.window(start, n)
        out[1, 1:n] = 1  # targets are tokens 1..n-1 of the document
        if self.base.masks is not None:
            out[1, :n] &= self.base.masks.window(start, n)
        return out


class SubsetSource:
    """Samples `indices` of another source, in that order (one side of a held-out split)."""

    def __init__(self, base: SampleSource, indices: np.ndarray) -> None:
        self.base, self.indices = base, indices
        self.num_samples: Optional[int] = len(indices)

    def sample(self, index: int) -> np.ndarray:
        return self.base.sample(int(self.indices[index]))

    @property
    def margins(self) -> Optional[np.ndarray]:
        return getattr(self.base, "margins", None)

    def margin(self, index: int) -> float:
        return self.base.margin(int(self.indices[index]))


def held_out_split(num_samples: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sample indices: a fixed pseudo-random `fraction` of the windows is held out. Seeded by
    a constant, not training.seed, so runs with different seeds are judged on the same validation set."""
    k = min(num_samples, max(1, round(num_samples * fraction))) if fraction > 0 else 0
    mask = np.zeros(num_samples, dtype=bool)
    mask[np.random.default_rng([TAG_SPLIT]).permutation(num_samples)[:k]] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def check_kind(cfg: JobConfig) -> str:
    kind = str(cfg.data.kind)
    if kind != "synthetic" and not str(cfg.data.path):
        raise ConfigError(f"data.kind={kind} needs data.path: set data.path=<directory, file or glob>")
    return kind


def eval_enabled(cfg: JobConfig) -> bool:
    return int(cfg.training.eval_every) > 0


def shard_dir(cfg: JobConfig, run_dir: Path, role: str) -> str:
    """Where this role's token shards are: the user's shards, the run's text data, or a cache entry."""
    kind = str(cfg.data.kind)
    if kind == "tokens":
        return str(cfg.data.path if role == "train" else cfg.data.val_path)
    if kind == "text":
        path = Path(run_dir) / (RUN_DATA_DIR if role == "train" else RUN_VAL_DIR)
    else:
        sources_file = Path(run_dir) / SOURCES_FILE
        if not sources_file.is_file():
            raise InputError(
                f"data.kind={kind}: '{sources_file}' is missing; the launcher's prepare_run_data(cfg, run_dir) "
                f"must run before the workers"
            )
        path = Path(json.loads(sources_file.read_text())[role])
    if not (path / "meta.json").is_file():
        raise InputError(
            f"data.kind={kind}: '{path}' is not prepared; the launcher's prepare_run_data(cfg, run_dir) must run "
            f"before the workers"
        )
    return str(path)


def data_sources(cfg: JobConfig, run_dir: Path) -> tuple[SampleSource, Optional[SampleSource]]:
    """(training source, validation source or None). The validation source exists when evaluation is
    on or a validation set is configured; data.val_fraction carves it out of the training windows."""
    kind = check_kind(cfg)
    seq_len, vocab, seed = int(cfg.training.seq_len), int(cfg.model.vocab_size), int(cfg.training.seed)
    if kind == "synthetic" and cfg.objective.name == ObjectiveName.kto:
        from dtlaunch.data.unpaired import SyntheticExamples

        return SyntheticExamples(vocab, seq_len, seed, TAG_SYNTHETIC), None
    if kind == "synthetic" and cfg.objective.name != ObjectiveName.sft:
        from dtlaunch.data.preference import SyntheticPairs

        return SyntheticPairs(vocab, seq_len, seed, TAG_SYNTHETIC), None
    if kind == "synthetic":
        val = SyntheticSource(vocab, seq_len, seed, TAG_SYNTHETIC_VAL) if eval_enabled(cfg) else None
        return SyntheticSource(vocab, seq_len, seed), val
    if str(cfg.data.format) == "preference":
        return _pair_sources(cfg, run_dir)
    if str(cfg.data.format) == "unpaired":  # objective=kto; no validation source (job/rules/objective.py)
        from dtlaunch.data.unpaired import UnpairedSource

        return UnpairedSource(shard_dir(cfg, run_dir, "train"), seq_len, "data.path"), None
    tokens = TokenSource(shard_dir(cfg, run_dir, "train"), seq_len, "data.path")
    check_vocab(vocab, tokens.shards.vocab_size, f"data.path='{cfg.data.path}'")
    train: SampleSource = _unpacked(cfg, tokens)
    val: Optional[SampleSource] = None
    if str(cfg.data.val_path):
        val_tokens = TokenSource(shard_dir(cfg, run_dir, "val"), seq_len, "data.val_path")
        check_vocab(vocab, val_tokens.shards.vocab_size, f"data.val_path='{cfg.data.val_path}'")
        val = _unpacked(cfg, val_tokens)
    elif float(cfg.data.val_fraction) > 0:
        train_idx, val_idx = held_out_split(int(train.num_samples or 0), float(cfg.data.val_fraction))
        train, val = SubsetSource(train, train_idx), SubsetSource(train, val_idx)
    return train, val


def _pair_sources(cfg: JobConfig, run_dir: Path) -> tuple[SampleSource, Optional[SampleSource]]:
    """data.format=preference: one sample per pair (dtlaunch.data.preference.PairSource)."""
    from dtlaunch.data.preference import PairSource

    seq_len = int(cfg.training.seq_len)
    train: SampleSource = PairSource(shard_dir(cfg, run_dir, "train"), seq_len, "data.path")
    val: Optional[SampleSource] = None
    if str(cfg.data.val_path):
        val = PairSource(shard_dir(cfg, run_dir, "val"), seq_len, "data.val_path")
    elif float(cfg.data.val_fraction) > 0:
        train_idx, val_idx = held_out_split(int(train.num_samples or 0), float(cfg.data.val_fraction))
        train, val = SubsetSource(train, train_idx), SubsetSource(train, val_idx)
    return train, val


def _unpacked(cfg: JobConfig, source: TokenSource) -> Any:
    """data.pack=false: one document per sample (see DocumentSource); packed windows otherwise."""
    if bool(cfg.data.pack):
        return source
    eos = source.shards.meta.get("eos_id")
    if eos is None:
        raise ConfigError(
            f"data.pack=false needs an end-of-document token, but data.path='{cfg.data.path}' was tokenized "
            f"without one: use a tokenizer with an EOS token or data.pack=true"
        )
    return DocumentSource(source, int(eos), int(cfg.training.seq_len))
