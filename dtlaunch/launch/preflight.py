"""Checks the launcher runs after the run directory is ready and before any worker starts.

What the workers would otherwise find one by one, minutes in and as a worker failure (exit 1), is
found here as bad input (exit 2): token ids the model has no embedding row for, and a checkpoint to
resume that is corrupt or was written for a different model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from dtlaunch.config.layout import Layout
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.errors import ConfigError, InputError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Token ids scanned for the vocabulary check: whole corpora up to this size (a memory-mapped max runs
# at several GB/s), evenly spaced windows of a larger one.
SCAN_TOKENS = 64 << 20
WINDOW = 1 << 20


def check_data(cfg: JobConfig, run_dir: Path, layout: Layout) -> None:
    """A scan of the prepared token shards (training and validation): every id < model.vocab_size.
    (That each holds one global batch is checked by prepare_run_data, which runs just before.)"""
    from dtlaunch.data.shards import open_shards
    from dtlaunch.data.sources import shard_dir

    if str(cfg.data.kind) == "synthetic" or str(cfg.data.format) == "prompt":  # prompts: checked when prepared
        return
    roles = [("train", "data.path", cfg.data.path)]
    if str(cfg.data.val_path):
        roles.append(("val", "data.val_path", cfg.data.val_path))
    vocab = int(cfg.model.vocab_size)
    for role, key, value in roles:
        shards = open_shards(shard_dir(cfg, run_dir, role), key)
        for arr in shards.arrays:
            top, where = _max_id(arr)
            if top >= vocab:
                raise InputError(
                    f"{key}='{value}': token id {top} at position {where:,} of a shard is >= "
                    f"model.vocab_size={vocab}: the data was tokenized with a larger vocabulary; set "
                    f"model.vocab_size={top + 1} or more, or re-prepare the data"
                )


def _max_id(arr: np.ndarray) -> tuple[int, int]:
    """(largest id, its position) over the shard, or over evenly spaced windows of a very large one."""
    if len(arr) <= SCAN_TOKENS:
        windows = [(0, len(arr))]
    else:
        n = SCAN_TOKENS // WINDOW
        starts = np.linspace(0, len(arr) - WINDOW, n).astype(np.int64)
        windows = [(int(s), int(s) + WINDOW) for s in starts]
    top, where = -1, 0
    for lo, hi in windows:
        part = arr[lo:hi]
        if len(part) == 0:
            continue
        i = int(np.argmax(part))
        if int(part[i]) > top:
            top, where = int(part[i]), lo + i
    return top, where


def check_resume(cfg: JobConfig, run_dir: Path, say: Callable[[str], None]) -> Optional[Any]:
    """The checkpoint the workers will resume from (contents verified, newest intact first), checked
    against the config: same parameter names and shapes. Returns its CheckpointInfo, or None."""
    import os

    from dtlaunch.run.checkpoints import checkpoint_root, newest_complete, resolve_load_path
    from dtlaunch.run.env import NO_RESUME_ENV, VERIFIED_ENV

    os.environ.pop(VERIFIED_ENV, None)
    if os.environ.get(NO_RESUME_ENV) == "1":
        return None
    load_path = str(cfg.checkpoint.load_path)
    if load_path:
        p = Path(load_path)
        info, skipped = resolve_load_path(p if p.is_absolute() or p.exists() else Path(run_dir) / p, verify=True)
    elif cfg.checkpoint.enabled:
        info, skipped = newest_complete(checkpoint_root(cfg, run_dir), verify=True)
    else:
        return None
    for s in skipped:
        say(f"skipping checkpoint {s.name}: {s.reason}")
    if info is None:
        return None
    if skipped:
        say(f"resuming from {info.name} (step {info.step}), the newest intact checkpoint")
    check_model_matches(cfg, info)
    if info.verified:
        from dtlaunch.run.checkpoints import verified_stamp

        os.environ[VERIFIED_ENV] = verified_stamp(info.path)
    return info


def check_model_matches(cfg: JobConfig, info: Any) -> None:
    """The checkpoint's model tensors (names and shapes, from its .metadata) against the config's model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlaunch.convert.base_fingerprint import check_base
    from dtlaunch.models.registry import model_spec
    from dtlaunch.models.saved_tensors import saved_model_tensors

    check_base(cfg, info.marker, f"checkpoint {info.name} in '{info.path.parent}'")
    saved_model = info.marker.get("model", {})
    wanted = {k: v for k, v in _model_fields(cfg).items() if k != "init_from"}
    differs = [k for k, v in wanted.items() if k in saved_model and saved_model[k] != v]
    try:
        meta = dcp.FileSystemReader(str(info.path)).read_metadata()
    except Exception as exc:  # verified above; an unreadable one is still input, never a crash
        raise InputError(f"checkpoint '{info.path}' has an unreadable .metadata ({type(exc).__name__})") from None
    saved = {
        k[len("model.") :]: tuple(md.size)
        for k, md in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    spec = model_spec(cfg.model)
    model = spec.build(cfg.model, rope_len=1, device="meta")
    trained_in_full: tuple[str, ...] = ()
    if cfg.objective.name == ObjectiveName.reward:  # as the workers build it: the scalar head for the LM head
        from dtlaunch.models.score_head import add_score_head

        trained_in_full = add_score_head(model)
    peft = str(cfg.peft.method) != "none"
    if (
        peft
    ):  # as the workers adapt it (dtlaunch.train.features.peft); then the checkpoint holds the trained tensors only
        from dtlaunch.models.lora import apply_lora

        apply_lora(model, spec, cfg.peft, trained_in_full)
    # The names the checkpoint writer saves, from the same function (a tied head included).
    expected = {n: tuple(t.shape) for n, t in saved_model_tensors(model, trainable_only=peft).items()}
    mismatch = next((n for n in expected if saved.get(n) != expected[n]), None)
    if mismatch is None:
        extra = sorted(set(saved) - set(expected))
        mismatch = extra[0] if extra else None
    if mismatch is None and not differs:
        return
    what = ", ".join(f"model.{k}: checkpoint {saved_model[k]}, config {wanted[k]}" for k in differs[:3])
    if mismatch is not None:
        shape = f"checkpoint {saved.get(mismatch, 'absent')}, config {expected.get(mismatch, 'absent')}"
        what = (what + "; " if what else "") + f"tensor {mismatch}: {shape}"
    raise ConfigError(
        f"checkpoint {info.name} in '{info.path.parent}' was written for a different model ({what}): resume with "
        f"the model it was written for, or start a new run.dir"
    )


def _model_fields(cfg: JobConfig) -> dict:
    from dtlaunch.config.schema import to_dict

    return dict(to_dict(cfg)["model"])
