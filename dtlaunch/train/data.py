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

from dtlaunch.data.shards import open_shards
from dtlaunch.data.tokenizer import check_vocab, load_tokenizer
from dtlaunch.errors import ConfigError, DtlaunchError, InputError

KINDS = ("synthetic", "tokens", "text")
RUN_DATA_DIR = "data"
# Distinct seed-sequence tags so sample contents and epoch orders never share a random stream.
_TAG_SYNTHETIC, _TAG_ORDER = 0x5A17, 0x0D3E


class SampleSource(Protocol):
    num_samples: Optional[int]  # None = unbounded (synthetic)

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticSource:
    """Uniform random ids; sample k depends only on (seed, k), so any layout sees identical data."""

    num_samples: Optional[int] = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.length, self.seed = vocab_size, seq_len + 1, seed

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _TAG_SYNTHETIC, index])
        return rng.integers(0, self.vocab_size, self.length, dtype=np.int64)


class TokenSource:
    """Sample i = tokens [i*seq_len, i*seq_len + seq_len + 1) of the concatenated shards (the last
    token of one window is the first of the next, so every token is a target exactly once)."""

    def __init__(self, path: str, seq_len: int, key: str) -> None:
        self.shards = open_shards(path, key)
        self.seq_len = seq_len
        self.num_samples: Optional[int] = max(0, (self.shards.total - 1) // seq_len)

    def sample(self, index: int) -> np.ndarray:
        return self.shards.window(index * self.seq_len, self.seq_len + 1)


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
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        self.source, self.micro_batch, self.seq_len, self.seed = source, micro_batch, seq_len, seed
        self.dp_rank, self.dp_size, self.vocab_size, self.key = dp_rank, dp_size, vocab_size, key
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
        return int(self._order(position // n)[position % n])

    def next_indices(self) -> list[int]:
        """Sample indices of this rank's next micro-batch; advances the global position."""
        start = self.consumed + self.dp_rank * self.micro_batch
        idx = [self.sample_index(start + i) for i in range(self.micro_batch)]
        self.consumed += self.micro_batch * self.dp_size
        return idx

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.source.sample(i) for i in self.next_indices()])
        top = int(rows.max())
        if top >= self.vocab_size:
            # Caught here, on the host: on a GPU an out-of-range id is an opaque device-side assert.
            raise InputError(
                f"{self.key}: token id {top} >= model.vocab_size={self.vocab_size}: the data was "
                f"tokenized with a larger vocabulary; raise model.vocab_size or re-prepare the data"
            )
        batch = torch.from_numpy(rows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

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
    if kind not in KINDS:
        raise ConfigError(f"data.kind='{kind}' is not a data kind: use one of {', '.join(KINDS)}")
    if kind != "synthetic" and not str(cfg.data.path):
        raise ConfigError(f"data.kind={kind} needs data.path: set data.path=<directory, file or glob>")
    return kind


def _text_source_id(cfg: Any) -> dict[str, Any]:
    return {
        "path": str(cfg.data.path),
        "pattern": str(cfg.data.pattern),
        "tokenizer": str(cfg.data.tokenizer),
        "max_bytes": int(cfg.data.max_bytes),
    }


def prepare_run_data(cfg: Any, run_dir: Path) -> Optional[Any]:
    """Called once by the launcher before workers start. Tokenizes data.kind=text into run_dir/data
    (skipped when already there from the same source, e.g. on resume) and checks data.kind=tokens
    shards, so a bad corpus fails before any worker spawns. Returns the PrepareSummary or None."""
    from dtlaunch.data.prepare import prepare_corpus

    kind = _check_kind(cfg)
    if kind == "tokens":
        source = TokenSource(str(cfg.data.path), int(cfg.training.seq_len), "data.path")
        check_vocab(int(cfg.model.vocab_size), source.shards.vocab_size, f"data.path='{cfg.data.path}'")
        return None
    if kind != "text":
        return None
    out = Path(run_dir) / RUN_DATA_DIR
    ident = _text_source_id(cfg)
    meta_file = out / "meta.json"
    if meta_file.is_file():
        import json

        if json.loads(meta_file.read_text()).get("source") == ident:
            return None
    tok = load_tokenizer(str(cfg.data.tokenizer))
    check_vocab(int(cfg.model.vocab_size), tok.vocab_size, f"data.tokenizer='{cfg.data.tokenizer}'")
    return prepare_corpus(
        [str(cfg.data.path)],
        out,
        tok,
        pattern=str(cfg.data.pattern),
        max_bytes=int(cfg.data.max_bytes),
        key="data.path",
        extra_meta={"source": ident},
    )


def build_loader(cfg: Any, run_dir: Path, dp_rank: int, dp_size: int) -> TokenLoader:
    """This dp rank's loader. TP/PP peers pass the same dp_rank and so get identical batches."""
    kind = _check_kind(cfg)
    seq_len, mb = int(cfg.training.seq_len), int(cfg.training.micro_batch)
    vocab = int(cfg.model.vocab_size)
    source: SampleSource
    if kind == "synthetic":
        source = SyntheticSource(vocab, seq_len, int(cfg.training.seed))
    else:
        path = str(cfg.data.path) if kind == "tokens" else str(Path(run_dir) / RUN_DATA_DIR)
        if kind == "text" and not (Path(path) / "meta.json").is_file():
            raise InputError(
                f"data.kind=text: '{path}' is not prepared; the launcher's prepare_run_data(cfg, "
                f"run_dir) must run before the workers"
            )
        source = TokenSource(path, seq_len, "data.path")
        check_vocab(vocab, source.shards.vocab_size, f"data.path='{cfg.data.path}'")
        gb = global_batch_size(cfg, dp_size)
        if source.num_samples < gb:
            raise DtlaunchError(
                f"data.path='{cfg.data.path}' holds {source.num_samples} samples of {seq_len + 1} tokens but one "
                f"global batch needs {gb}: add data, or lower training.seq_len / training.global_batch / "
                f"training.micro_batch"
            )
    return TokenLoader(source, mb, seq_len, int(cfg.training.seed), dp_rank, dp_size, vocab)
