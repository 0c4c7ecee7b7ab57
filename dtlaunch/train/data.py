"""The worker's data loader: this data-parallel rank's slice of the global sample order, as tensors.

Micro-step j of optimizer step s on dp rank r reads stream positions `s*gb + j*mb*dp + r*mb ... + mb`:
"the next mb*dp positions, rank r takes slice r". Which sample each stream position is, for every
layout alike, is dtlaunch.data.sources (prepared by the launcher, dtlaunch.launch.run_data, before this
worker started); the loader's state is that one global position, restorable into any dp size.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from dtlaunch.config.decisions import global_batch_size
from dtlaunch.data.sources import (
    TAG_ORDER,
    SampleSource,
    SubsetSource,
    TokenSource,
    data_sources,
    eval_enabled,
)
from dtlaunch.errors import ConfigError, DtlaunchError, InputError
from dtlaunch.train.batch import MicroBatch

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

IGNORE_INDEX = -100  # cross_entropy's default: a target that does not count


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


def check_ids(rows: np.ndarray, vocab_size: int, key: str) -> None:
    """Every id of a batch inside [0, vocab_size), checked on the host: on a GPU an out-of-range id is an
    opaque device-side assert, on a CPU an IndexError deep in the embedding."""
    low, top = int(rows.min()), int(rows.max())
    if low < 0:
        raise InputError(f"{key}: token id {low} < 0: the data is not token ids; re-prepare the data")
    if top >= vocab_size:
        raise InputError(
            f"{key}: token id {top} >= model.vocab_size={vocab_size}: the data was "
            f"tokenized with a larger vocabulary; raise model.vocab_size or re-prepare the data"
        )


class TokenLoader:
    """Yields this dp rank's micro-batches in order: MicroBatch, inputs and targets int64 (micro_batch, seq_len)."""

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
            from dtlaunch.train.parallel.context_parallel import local_positions

            self.cp_positions = local_positions(seq_len, cp_rank, cp_size)
        self.cp_size = cp_size
        self.source, self.micro_batch, self.seq_len, self.seed = source, micro_batch, seq_len, seed
        self.dp_rank, self.dp_size, self.vocab_size, self.key = dp_rank, dp_size, vocab_size, key
        self.shuffle = shuffle  # validation reads its samples in order
        self.global_batch = global_batch or micro_batch * dp_size
        self._targets_cache: tuple[int, int] = (-1, 0)
        # data.document_mask: the EOS id that ends each document (the batch's model_args then hold per-document
        # positions and document ids).
        self.document_eos: Optional[int] = None
        # Preference pairs with precomputed reference log-probs: (pairs, 2) [chosen, rejected] per sample (each
        # batch's MicroBatch.ref_logps, DPO's Precomputed reference).
        self.ref_logps: Optional[np.ndarray] = None
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
            perm = np.random.default_rng([self.seed, TAG_ORDER, epoch]).permutation(n)
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

    def next_batch(self) -> MicroBatch:
        step_start = (self.consumed // self.global_batch) * self.global_batch
        indices = self.next_indices()
        rows = np.stack([self.source.sample(i) for i in indices])
        mask = None
        pairs = rows.ndim == 4
        weight: Optional[float] = None
        model_args: dict[str, torch.Tensor] = {}
        ref_logps = labels = margins = None
        if pairs:  # preference pairs (mb, 2, 2, S+1): the chosen rows, then the rejected rows, as TRL stacks them
            rows = np.concatenate([rows[:, 0], rows[:, 1]])
            if getattr(self.source, "margins", None) is not None:  # data.margin_field: objective=reward's margins
                margins = torch.tensor([self.source.margin(i) for i in indices], dtype=torch.float32)
            if self.ref_logps is not None:
                ref = self.ref_logps[indices]
                ref_logps = torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]))
            if hasattr(self.source, "labels"):
                labels = torch.from_numpy(self.source.labels(indices))
        if rows.ndim == 3:  # masked data: targets that are not to be learnt get the ignore index
            rows, mask = rows[:, 0], rows[:, 1, 1:]
        if mask is not None and not pairs:
            # Loss = sum over this micro-batch's targets * weight / accum, so that the sum over micro-steps,
            # averaged over dp ranks, is the mean over every target of the global batch: independent of
            # how the batch is split (layout, accumulation) and of how many targets each micro-batch holds.
            total = self._global_targets(step_start)
            # Under CP each rank sums over its share of the tokens and gradients are averaged over the CP
            # ranks too: cp_size makes that average the sum again.
            weight = self.global_batch * self.cp_size / (self.micro_batch * total) if total else 0.0
        check_ids(rows, self.vocab_size, self.key)
        batch = torch.from_numpy(rows)
        if self.document_eos is not None:
            model_args = document_inputs(rows[:, :-1], self.document_eos)
        # Inputs and targets never share storage: for a one-row batch `batch[:, 1:].contiguous()` is a view of
        # the inputs, and writing the ignore index into it would write -100 into the inputs.
        inputs, targets = batch[:, :-1].clone(), batch[:, 1:].clone()
        if mask is not None:
            targets[torch.from_numpy(mask == 0)] = IGNORE_INDEX
        if self.cp_positions is not None:
            keep = torch.from_numpy(self.cp_positions)
            inputs, targets = inputs[:, keep], targets[:, keep]
            model_args = {"positions": keep}
        return MicroBatch(
            inputs.contiguous(),
            targets.contiguous(),
            loss_weight=weight,
            model_args=model_args,
            indices=tuple(indices),
            ref_logps=ref_logps,
            labels=labels,
            margins=margins,
        )

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


def build_loader(cfg: JobConfig, run_dir: Path, dp_rank: int, dp_size: int) -> TokenLoader:
    """This dp rank's loader. TP/PP peers pass the same dp_rank and so get identical batches."""
    return build_loaders(cfg, run_dir, dp_rank, dp_size)[0]


def build_loaders(
    cfg: JobConfig, run_dir: Path, dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1
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


def _document_eos(cfg: JobConfig, source: Any) -> Optional[int]:
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
