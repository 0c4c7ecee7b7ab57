"""Which frozen base a fine-tuning run's adapters belong to: its path and a content fingerprint.

A LoRA checkpoint holds the adapters only; resuming or exporting it re-reads the base from
`model.init_from`. Adapters on another base (a different checkpoint of the same architecture: Instruct
instead of Base, another fine-tune) would load without error and silently compute something else, so the
checkpoint records the base's fingerprint and a mismatch is refused.

The fingerprint is cheap at any size: config.json, every safetensors file's size and header (tensor names,
dtypes, shapes, offsets) and 16 samples of 4 KiB spread over each file's data. Two different trainings
of one architecture differ in every tensor, so the samples tell them apart; a single edited weight may
go unnoticed (this is a guard against using the wrong directory, not an integrity check). Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.inputs.hf_dir import INDEX_FILE, SINGLE_FILE, weight_files

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

SAMPLES = 16
SAMPLE_BYTES = 4096
CONFIG = "config.json"


def fingerprint(path: str | Path) -> str:
    """'sha256:<hex>' of the base directory's config and weights (see the module docstring)."""
    p = Path(path).expanduser().resolve()
    files = weight_files(p)
    if not files:
        raise InputError(f"'{p}' has no {SINGLE_FILE} or {INDEX_FILE}: it is not a Hugging Face model directory")
    stamp = tuple((f, (p / f).stat().st_size, (p / f).stat().st_mtime_ns) for f in files)
    return _fingerprint(str(p), stamp)


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, stamp: tuple) -> str:
    """Cached per process by (path, file sizes and times): each checkpoint save asks again."""
    p = Path(path)
    h = hashlib.sha256()
    cfg = p / CONFIG
    if cfg.is_file():
        # Key order and whitespace do not change the model.
        h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
    for name, size, _ in stamp:
        h.update(f"{name}:{size}\n".encode())
        with open(p / name, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))  # the header: names, dtypes, shapes, offsets
            start = 8 + n
            span = max(0, size - start - SAMPLE_BYTES)
            for i in range(SAMPLES):
                fh.seek(start + span * i // max(1, SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
    return f"sha256:{h.hexdigest()}"


def peft_record(cfg: JobConfig) -> Optional[dict]:
    """What a checkpoint's marker records about its adapters and their base; None without peft."""
    peft = getattr(cfg, "peft", None)
    if peft is None or str(peft.method) == "none":
        return None
    src = str(cfg.model.init_from)
    return {
        "method": str(peft.method),
        "rank": int(peft.rank),
        "alpha": float(peft.alpha),
        "dropout": float(peft.dropout),
        "targets": [str(t) for t in peft.targets],
        "base": src,
        "base_fingerprint": fingerprint(_weights_dir(src)) if WeightSource.parse(src).is_hf else None,
        # QLoRA's NF4 base is quantised from this dtype: a merged export rounds the same way.
        "base_dtype": str(cfg.precision.param_dtype),
        "nf4_block_size": int(peft.nf4_block_size),
        "nf4_scaler_block_size": int(peft.nf4_scaler_block_size),
    }


def _weights_dir(src: str) -> Path:
    from dtlaunch.hub.model_source import hf_weights_dir

    return Path(str(hf_weights_dir(src)))  # a hub name: its pinned snapshot in the cache


def check_base(cfg: JobConfig, marker: dict, where: str) -> None:
    """Refuse to continue adapters on another base than the one they were trained on (or to mix a full
    training checkpoint with a peft run): a ConfigError naming both and the fix."""
    saved, now = marker.get("peft"), peft_record(cfg)
    if saved is None and now is None:
        return
    if saved is None:
        raise ConfigError(
            f"{where} holds a full training run, not adapters: set peft.method=none to resume it, "
            f"or start a new run.dir for peft.method={now['method']}"
        )
    if now is None:
        raise ConfigError(
            f"{where} holds {saved['method']} adapters: set peft={saved['method']} to resume it, or start a new run.dir"
        )
    if saved.get("base_fingerprint") != now["base_fingerprint"]:
        raise ConfigError(
            f"{where} holds adapters trained on base {saved.get('base')} ({saved.get('base_fingerprint')}), but "
            f"model.init_from={now['base']} is a different model ({now['base_fingerprint']}): set "
            f"model.init_from to the base the adapters were trained on"
        )
