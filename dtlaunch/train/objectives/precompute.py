"""objective.precompute_reference: one pass over every pair before training, the reference log-probs
written beside the pairs' token-cache entry, so that training holds no reference model.

The file is keyed by what decides the values (the reference, for a run the checkpoint it resolves to; the
model section, the seed of a random base, LoRA's adapters-off base, training.seq_len's cut, the compute
dtype): a second run with the same inputs reads it instead of running the pass. Each data-parallel rank scores every dp-th micro-batch of
pairs in stream order (the last one wrapping round, so all ranks run the same number of forwards, as
FSDP's collectives need); the values are gathered to every rank and global rank 0 writes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.data.sources import shard_dir
from dtlaunch.run.phases import phase
from dtlaunch.train.data import TokenLoader
from dtlaunch.train.objectives.reference import build_reference
from dtlaunch.train.parallel.mesh import cp_rank_size, dp_rank_size
from dtlaunch.train.parallel.parallelize import compute_context

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def reference_key(cfg: JobConfig) -> str:
    from omegaconf import OmegaConf

    ident = {
        "reference": str(cfg.objective.reference),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "seed": int(cfg.training.seed),
        "peft": str(cfg.peft.method),
        "seq_len": int(cfg.training.seq_len),
        "dtype": str(cfg.precision.param_dtype),
    }
    ref = str(cfg.objective.reference)
    if ref != "base" and not WeightSource.parse(ref).is_hf:
        # A run directory as the reference: its values are those of the checkpoint it resolves to now (a
        # run that saved a newer one since gives other log-probs).
        from dtlaunch.run.checkpoints import resolve_load_path

        info, _ = resolve_load_path(Path(ref).expanduser())
        ident["checkpoint"] = {"path": str(info.path.resolve()), "marker": info.marker}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def reference_file(cfg: JobConfig, run_dir: Path) -> Path:
    return Path(shard_dir(cfg, run_dir, "train")) / f"ref_logps-{reference_key(cfg)}.npy"


def precomputed_reference(cfg: JobConfig, run_dir: Path, rt: Any, loader: TokenLoader) -> np.ndarray:
    """(pairs, 2) reference log-probs [chosen, rejected] of every pair of the training source."""
    path = reference_file(cfg, run_dir)
    if path.is_file():
        phase(f"reference log-probs from {path}")
        return np.load(path)
    n = int(loader.source.num_samples or 0)
    phase(f"precomputing the reference log-probs of {n} pairs (objective.precompute_reference)")
    table = score_pairs(cfg, rt, loader, n)
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
        np.save(tmp, table)
        os.replace(tmp, path)
    return table


def score_pairs(cfg: JobConfig, rt: Any, loader: TokenLoader, n: int) -> np.ndarray:
    reference = build_reference(cfg, rt.decisions, rt.mesh, rt.model_parts, live=True)
    dp_rank, dp_size = dp_rank_size(rt.mesh) if rt.mesh is not None else (0, 1)
    cp_rank, cp_size = cp_rank_size(rt.mesh) if rt.mesh is not None else (0, 1)
    mb = loader.micro_batch
    # CP peers read the same pairs, each its chunks of them (their sums are added over the CP group).
    src, seq, vocab = loader.source, loader.seq_len, loader.vocab_size
    cp = {"cp_rank": cp_rank, "cp_size": cp_size}
    order = TokenLoader(src, mb, seq, loader.seed, dp_rank, dp_size, vocab, shuffle=False, **cp)
    rounds = -(-n // (mb * dp_size))
    indices, values = [], []
    for _ in range(rounds):
        batch = order.next_batch()
        inputs, targets = (t.to(rt.device) for t in (batch.inputs, batch.targets))
        with rt.loss_context(), compute_context(rt.model_parts, cfg, rt.device):
            logps = reference(inputs, targets, batch).float().cpu()
        indices += batch.indices
        values.append(torch.stack(logps.chunk(2), dim=1))  # (mb, 2): chosen, rejected
    mine = (indices, torch.cat(values).tolist())
    gathered: list = [mine]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    table = np.full((n, 2), np.nan)
    for idx, vals in gathered:
        table[idx] = vals
    del reference  # the frozen copy, if any, goes with it: training holds no reference model
    return table
