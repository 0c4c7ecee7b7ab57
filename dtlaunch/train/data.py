"""Training data: one global sample order, sliced by data-parallel rank.

The order is defined for the whole job, not per rank: sample stream position k maps to sample
`perm_e[k % N]` where e = k // N is the epoch and perm_e a permutation seeded by (training.seed, e).
Micro-step j of optimizer step s on dp rank r reads stream positions
`s*gb + j*mb*dp + r*mb ... + mb`, which is simply "the next mb*dp positions, rank r takes slice r".
Hence DP(2) x mb 4 and one process x mb 8 see the same samples, TP/PP peers (same dp rank) see the
same batch, and the loader's state is one global number (samples consumed) that a checkpoint can
restore into any dp size. Epochs flow into each other without dropping a tail: every sample is seen
exactly once per epoch; a global batch may straddle two epochs.

Kinds: synthetic (uniform random ids, sample k generated from (seed, k): free and layout-independent),
tokens (memory-mapped shards, fixed windows of seq_len+1 tokens), text (tokenized once into
run_dir/data by `prepare_run_data`, then read as tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np
import torch

from dtlaunch.data.shards import open_masks, open_shards
from dtlaunch.data.tokenizer import check_vocab, load_tokenizer
from dtlaunch.errors import ConfigError, DtlaunchError, InputError

RECORD_KINDS = ("jsonl", "parquet", "hf")
IGNORE_INDEX = -100  # cross_entropy's default: a target that does not count
RUN_DATA_DIR = "data"
RUN_VAL_DIR = "data-val"
# Where the launcher tells workers which token-cache entries hold a record kind's train / val data.
SOURCES_FILE = "data_sources.json"
# Distinct seed-sequence tags so sample contents, epoch orders, the held-out split and synthetic
# validation data never share a random stream.
_TAG_SYNTHETIC, _TAG_ORDER, _TAG_SPLIT, _TAG_SYNTHETIC_VAL = 0x5A17, 0x0D3E, 0x5B11, 0x7A15


class SampleSource(Protocol):
    num_samples: Optional[int]  # None = unbounded (synthetic)

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticSource:
    """Uniform random ids; sample k depends only on (seed, k), so any layout sees identical data."""

    num_samples: Optional[int] = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int, tag: int = _TAG_SYNTHETIC) -> None:
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


def document_inputs(inputs: np.ndarray, eos: int) -> dict[str, torch.Tensor]:
    """Per-token document ids and positions within the document, from the EOS tokens of (B, S) inputs: a
    document ends with its EOS, the next starts after it (a window starts inside some document: position 0
    there, which is all the model can see of it anyway)."""
    ends = inputs == eos
    doc = np.zeros_like(inputs)
    doc[:, 1:] = np.cumsum(ends, axis=1)[:, :-1]
    idx = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    # Start of each token's document: the running maximum of "index after the last EOS".
    starts = np.maximum.accumulate(
        np.where(np.concatenate([np.ones_like(ends[:, :1]), ends[:, :-1]], axis=1), idx, 0), axis=1
    )
    return {"positions": torch.from_numpy(idx - starts), "doc_ids": torch.from_numpy(doc)}


def held_out_split(num_samples: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sample indices: a fixed pseudo-random `fraction` of the windows is held out. Seeded by
    a constant, not training.seed, so runs with different seeds are judged on the same validation set."""
    k = min(num_samples, max(1, round(num_samples * fraction))) if fraction > 0 else 0
    mask = np.zeros(num_samples, dtype=bool)
    mask[np.random.default_rng([_TAG_SPLIT]).permutation(num_samples)[:k]] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


class TokenLoader:
    """Yields this dp rank's micro-batches in order: (inputs, targets), int64, (micro_batch, seq_len)."""

    def __init__(
        self,
        source: SampleSource,
        micro_batch: int,
        seq_len: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
        vocab_size: int,
        key: str = "data.path",
        shuffle: bool = True,
        global_batch: int = 0,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        # Context parallel: this rank keeps only its load-balanced chunks of every sequence (and hands
        # the model their true positions for RoPE); its CP peers read the same samples.
        self.cp_positions: Optional[np.ndarray] = None
        if cp_size > 1:
            from dtlaunch.train.context_parallel import local_positions

            self.cp_positions = local_positions(seq_len, cp_rank, cp_size)
        self.cp_size = cp_size
        self.source, self.micro_batch, self.seq_len, self.seed = source, micro_batch, seq_len, seed
        self.dp_rank, self.dp_size, self.vocab_size, self.key = dp_rank, dp_size, vocab_size, key
        self.shuffle = shuffle  # validation reads its samples in order
        self.global_batch = global_batch or micro_batch * dp_size
        # Masked data: the factor that turns this micro-batch's summed target loss into its share of the
        # global batch's mean (see loss_weight); None for unmasked data (a plain mean is exact there).
        self.last_weight: Optional[float] = None
        self._targets_cache: tuple[int, int] = (-1, 0)
        # data.document_mask: the EOS id that ends each document, and the model's extra inputs for the
        # last batch (per-document positions and document ids), else empty.
        self.document_eos: Optional[int] = None
        self.last_model_args: dict[str, torch.Tensor] = {}
        self.consumed = 0  # global stream position: samples consumed by all dp ranks together
        self._perms: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        n = self.source.num_samples
        return 0 if n is None else self.consumed // n

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = self.source.num_samples
            assert n is not None
            perm = np.random.default_rng([self.seed, _TAG_ORDER, epoch]).permutation(n)
            # uint32 halves the memory of a large corpus's order; keep only the current and next epoch.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm.astype(np.uint32) if n < 2**32 else perm
        return self._perms[epoch]

    def sample_index(self, position: int) -> int:
        """Which sample the global stream holds at `position`."""
        n = self.source.num_samples
        if n is None:
            return position
        if not self.shuffle:
            return position % n
        return int(self._order(position // n)[position % n])

    def next_indices(self) -> list[int]:
        """Sample indices of this rank's next micro-batch; advances the global position."""
        start = self.consumed + self.dp_rank * self.micro_batch
        idx = [self.sample_index(start + i) for i in range(self.micro_batch)]
        self.consumed += self.micro_batch * self.dp_size
        return idx

    def _global_targets(self, step_start: int) -> int:
        """Targets that count in the global batch starting at stream position `step_start` (all ranks')."""
        if self._targets_cache[0] != step_start:
            n = sum(
                int(self.source.sample(self.sample_index(step_start + i))[1, 1:].sum())
                for i in range(self.global_batch)
            )
            self._targets_cache = (step_start, n)
        return self._targets_cache[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step_start = (self.consumed // self.global_batch) * self.global_batch
        rows = np.stack([self.source.sample(i) for i in self.next_indices()])
        mask = None
        if rows.ndim == 3:  # masked data: targets that are not to be learnt get the ignore index
            rows, mask = rows[:, 0], rows[:, 1, 1:]
            # Loss = sum over this micro-batch's targets * weight / accum, so that the sum over micro-steps,
            # averaged over dp ranks, is the mean over every target of the global batch: independent of
            # how the batch is split (layout, accumulation) and of how many targets each micro-batch holds.
            total = self._global_targets(step_start)
            # Under CP each rank sums over its share of the tokens and gradients are averaged over the CP
            # ranks too: cp_size makes that average the sum again.
            self.last_weight = self.global_batch * self.cp_size / (self.micro_batch * total) if total else 0.0
        top = int(rows.max())
        if top >= self.vocab_size:
            # Caught here, on the host: on a GPU an out-of-range id is an opaque device-side assert.
            raise InputError(
                f"{self.key}: token id {top} >= model.vocab_size={self.vocab_size}: the data was "
                f"tokenized with a larger vocabulary; raise model.vocab_size or re-prepare the data"
            )
        batch = torch.from_numpy(rows)
        if self.document_eos is not None:
            self.last_model_args = document_inputs(rows[:, :-1], self.document_eos)
        targets = batch[:, 1:].contiguous()
        if mask is not None:
            targets[torch.from_numpy(mask == 0)] = IGNORE_INDEX
        inputs = batch[:, :-1]
        if self.cp_positions is not None:
            keep = torch.from_numpy(self.cp_positions)
            inputs, targets = inputs[:, keep], targets[:, keep]
            self.last_model_args = {"positions": keep}
        return inputs.contiguous(), targets.contiguous()

    def state_dict(self) -> dict[str, Any]:
        # Global, not per rank: identical on every rank, and valid for any dp size on resume.
        return {
            "consumed_samples": self.consumed,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": -1 if self.source.num_samples is None else self.source.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed_samples"])


def global_batch_size(cfg: Any, dp_size: int) -> int:
    gb = int(cfg.training.global_batch)
    return gb if gb > 0 else int(cfg.training.micro_batch) * dp_size


def _check_kind(cfg: Any) -> str:
    kind = str(cfg.data.kind)
    if kind != "synthetic" and not str(cfg.data.path):
        raise ConfigError(f"data.kind={kind} needs data.path: set data.path=<directory, file or glob>")
    return kind


def eval_enabled(cfg: Any) -> bool:
    return int(cfg.training.eval_every) > 0


def _text_source_id(cfg: Any, path: str) -> dict[str, Any]:
    return {
        "path": path,
        "pattern": str(cfg.data.pattern),
        "tokenizer": str(cfg.data.tokenizer),
        "max_bytes": int(cfg.data.max_bytes),
    }


def _prepare_text(cfg: Any, path: str, out: Path) -> Optional[Any]:
    """data.kind=text: tokenize into the run directory (skipped when already there from the same source)."""
    import json

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


def record_options(cfg: Any) -> dict[str, Any]:
    """What, besides the files and the tokenizer, decides a record source's tokens (part of the cache key)."""
    kind = str(cfg.data.kind)
    return {
        "kind": kind,
        "format": str(cfg.data.format),
        "fields": record_fields(cfg),
        "split": str(cfg.data.split) if kind == "hf" else "",
        **_chat_template_id(cfg),
    }


def _chat_template_id(cfg: Any) -> dict[str, str]:
    """For chat records, how they were encoded and data.chat_template's text decide the tokens too."""
    from dtlaunch.data.chat_templates import template_identity

    if str(cfg.data.format) != "chat":
        return {}
    # "encoding": chat records are tokenized as one rendering (earlier entries, turn by turn, are not reused).
    spec = str(cfg.data.chat_template)
    return {"encoding": "whole", **({"chat_template": template_identity(spec)} if spec else {})}


def record_fields(cfg: Any) -> list[str]:
    """The record fields data.format reads."""
    fmt = str(cfg.data.format)
    if fmt == "chat":
        return [str(cfg.data.messages_field)]
    if fmt == "prompt_completion":
        return [str(cfg.data.prompt_field), str(cfg.data.completion_field)]
    return [str(cfg.data.text_field)]


def encoded_batches(cfg: Any, tok: Any, path: str, key: str) -> Any:
    """The source's documents, encoded lazily in batches (see dtlaunch.data.cache.write_tokens)."""
    from dtlaunch.data.cache import encode_batches
    from dtlaunch.data.records import iter_documents, iter_records

    kind, fmt, split = str(cfg.data.kind), str(cfg.data.format), str(cfg.data.split)
    if fmt == "text":
        return encode_batches(tok, iter_documents(kind, path, str(cfg.data.text_field), split, key))
    from dtlaunch.data.chat import ChatEncoder, encode_records

    encoder = ChatEncoder(Path(tok.name), tok._dtype, str(cfg.data.chat_template), chat=fmt == "chat")
    return encode_records(encoder, fmt, iter_records(kind, path, record_fields(cfg), split, key), key)


def tokenize_records(cfg: Any, path: str, key: str, tok: Any = None) -> Path:
    """A jsonl / parquet / hf source tokenized into the content-addressed cache; returns the entry."""
    from dtlaunch.data.cache import cache_root, cached_tokens
    from dtlaunch.data.records import source_files

    kind = str(cfg.data.kind)
    if tok is None:
        tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
    check_vocab(int(cfg.model.vocab_size), tok.vocab_size, f"data.tokenizer='{cfg.data.tokenizer}'")
    files = source_files(kind, path, key)
    masked = str(cfg.data.format) != "text"
    batches = encoded_batches(cfg, tok, path, key)
    root = cache_root(str(cfg.data.cache_dir))
    entry, _ = cached_tokens(root, files, batches, tok, record_options(cfg), path, key, masked=masked)
    return entry


def prepare_run_data(cfg: Any, run_dir: Path) -> Optional[Any]:
    """Called once by the launcher before workers start: tokenizes data.kind=text into run_dir/data and
    record kinds (jsonl / parquet / hf) into the token cache, checks data.kind=tokens shards and that
    train and validation data each hold a global batch, so bad data fails (exit 2) before any worker.
    Returns data.kind=text's PrepareSummary when it tokenized now, else None."""
    import json

    kind = _check_kind(cfg)
    summary = None
    val_path = str(cfg.data.val_path)
    keep_tokenizer(cfg, Path(run_dir))
    if kind in RECORD_KINDS:
        tok = load_tokenizer(str(cfg.data.tokenizer), str(cfg.model.init_from))
        sources = {"train": str(tokenize_records(cfg, str(cfg.data.path), "data.path", tok))}
        if val_path:
            sources["val"] = str(tokenize_records(cfg, val_path, "data.val_path", tok))
        (Path(run_dir) / SOURCES_FILE).write_text(json.dumps(sources, indent=1) + "\n")
    elif kind == "text":
        summary = _prepare_text(cfg, str(cfg.data.path), Path(run_dir) / RUN_DATA_DIR)
        if val_path:
            _prepare_text(cfg, val_path, Path(run_dir) / RUN_VAL_DIR)
    if kind != "synthetic":
        from dtlaunch.config.layout import Layout, global_batch, world_size

        gb = global_batch(cfg, Layout.resolve(cfg.strategy, world_size(cfg)))
        if kind == "tokens":
            from dtlaunch.config.tokenizer_choice import shards_tokenizer_problem

            meta = open_shards(_shard_dir(cfg, run_dir, "train"), "data.path").meta
            problem = shards_tokenizer_problem(cfg, str(meta.get("tokenizer", "")))
            if problem:
                raise ConfigError(problem)
        train, val = data_sources(cfg, run_dir)
        _check_enough(train, gb, "data.path", cfg)
        if val is not None:
            _check_enough(val, gb, "data.val_path" if val_path else "data.val_fraction", cfg)
    return summary


def keep_tokenizer(cfg: Any, run_dir: Path) -> None:
    """A Hugging Face tokenizer travels with the run (run_dir/tokenizer), so that `ckpt export --format hf`
    can write it beside the weights and `generate RUN_DIR` decode with it, even if the original file moves
    or changes. Synthetic runs from hf:DIR keep the model's tokenizer too (their data.tokenizer is it)."""
    from dtlaunch.data.tokenizer import RUN_TOKENIZER_DIR, copy_tokenizer_files, resolve_tokenizer_spec

    spec = resolve_tokenizer_spec(str(cfg.data.tokenizer), str(cfg.model.init_from))
    if spec in ("", "byte"):
        return
    path = Path(spec).expanduser()
    out = run_dir / RUN_TOKENIZER_DIR
    copy_tokenizer_files(path / "tokenizer.json" if path.is_dir() else path, out)
    if str(cfg.data.chat_template) and str(cfg.data.format) == "chat":
        from dtlaunch.data.chat_templates import load_chat_template
        from dtlaunch.data.tokenizer import set_chat_template

        # The template the run trained with goes with its tokenizer (and so into `ckpt export --format hf`).
        set_chat_template(out, load_chat_template(str(cfg.data.chat_template)))


def _check_enough(source: SampleSource, gb: int, key: str, cfg: Any) -> None:
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


def _shard_dir(cfg: Any, run_dir: Path, role: str) -> str:
    """Where this role's token shards are: the user's shards, the run's text data, or a cache entry."""
    import json

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


def data_sources(cfg: Any, run_dir: Path) -> tuple[SampleSource, Optional[SampleSource]]:
    """(training source, validation source or None). The validation source exists when evaluation is
    on or a validation set is configured; data.val_fraction carves it out of the training windows."""
    kind = _check_kind(cfg)
    seq_len, vocab, seed = int(cfg.training.seq_len), int(cfg.model.vocab_size), int(cfg.training.seed)
    if kind == "synthetic":
        val = SyntheticSource(vocab, seq_len, seed, _TAG_SYNTHETIC_VAL) if eval_enabled(cfg) else None
        return SyntheticSource(vocab, seq_len, seed), val
    tokens = TokenSource(_shard_dir(cfg, run_dir, "train"), seq_len, "data.path")
    check_vocab(vocab, tokens.shards.vocab_size, f"data.path='{cfg.data.path}'")
    train: SampleSource = _unpacked(cfg, tokens)
    val: Optional[SampleSource] = None
    if str(cfg.data.val_path):
        val_tokens = TokenSource(_shard_dir(cfg, run_dir, "val"), seq_len, "data.val_path")
        check_vocab(vocab, val_tokens.shards.vocab_size, f"data.val_path='{cfg.data.val_path}'")
        val = _unpacked(cfg, val_tokens)
    elif float(cfg.data.val_fraction) > 0:
        train_idx, val_idx = held_out_split(int(train.num_samples or 0), float(cfg.data.val_fraction))
        train, val = SubsetSource(train, train_idx), SubsetSource(train, val_idx)
    return train, val


def build_loader(cfg: Any, run_dir: Path, dp_rank: int, dp_size: int) -> TokenLoader:
    """This dp rank's loader. TP/PP peers pass the same dp_rank and so get identical batches."""
    return build_loaders(cfg, run_dir, dp_rank, dp_size)[0]


def build_loaders(
    cfg: Any, run_dir: Path, dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1
) -> tuple[TokenLoader, Optional[TokenLoader]]:
    """(training loader, validation loader or None when evaluation is off) for this dp rank (and its
    chunks of each sequence under context parallel)."""
    seq_len, mb = int(cfg.training.seq_len), int(cfg.training.micro_batch)
    vocab, seed = int(cfg.model.vocab_size), int(cfg.training.seed)
    train, val = data_sources(cfg, run_dir)
    gb = global_batch_size(cfg, dp_size)
    if train.num_samples is not None and train.num_samples < gb:
        raise DtlaunchError(
            f"data.path='{cfg.data.path}' holds {train.num_samples} samples of {seq_len + 1} tokens but one "
            f"global batch needs {gb}: add data, or lower training.seq_len / training.global_batch / "
            f"training.micro_batch"
        )
    cp = {"cp_rank": cp_rank, "cp_size": cp_size}
    loader = TokenLoader(train, mb, seq_len, seed, dp_rank, dp_size, vocab, global_batch=gb, **cp)
    eos = _document_eos(cfg, train)
    loader.document_eos = eos
    if val is None or not eval_enabled(cfg):
        return loader, None
    val_loader = TokenLoader(
        val, mb, seq_len, seed, dp_rank, dp_size, vocab, key="data.val_path", shuffle=False, global_batch=gb, **cp
    )
    val_loader.document_eos = eos
    return loader, val_loader


def _unpacked(cfg: Any, source: TokenSource) -> Any:
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


def _document_eos(cfg: Any, source: Any) -> Optional[int]:
    if not bool(cfg.data.document_mask):
        return None
    base = source.base if isinstance(source, SubsetSource) else source
    eos = base.shards.meta.get("eos_id") if isinstance(base, TokenSource) else None
    if not bool(cfg.data.pack):
        return None  # one document per sample: nothing to keep apart
    if eos is None:
        raise ConfigError(
            f"data.document_mask=true needs an end-of-document token, but the data at data.path='{cfg.data.path}' "
            f"was tokenized without one: use a tokenizer with an EOS token or data.document_mask=false"
        )
    return int(eos)
