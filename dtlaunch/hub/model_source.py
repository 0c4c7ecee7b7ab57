"""Where an `hf:` model source's files are: a local directory, or a hub name's snapshot in the cache
(config.json fetched first, the weights when something needs them), and its config.json read and checked.

Torch-free, and below the model families: `hf_auto` builds from these, the job's composition
(dtlaunch.job.hf_model) types the model section from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError


def hf_source_dir(init_from: Any) -> Optional[Path]:
    """The directory holding config.json for hf:DIR, or for hf:ORG/NAME[@REV] its snapshot in the hub
    cache (config.json fetched if missing, nothing else); None for other sources."""
    name = hf_name(init_from)
    if name is None:
        return None
    if not name:
        raise ConfigError("model.init_from='hf:' names no directory: use model.init_from=hf:DIR or hf:ORG/NAME")
    from dtlaunch.hub.resolve import model_ref, model_snapshot

    ref = model_ref(name)  # an existing local directory wins over a hub name
    return Path(name).expanduser() if ref is None else model_snapshot(ref)


def hf_weights_dir(init_from: Any) -> Optional[Path]:
    """hf_source_dir, with a hub model's weights fetched into the cache first (once, with progress)."""
    path = hf_source_dir(init_from)
    from dtlaunch.hub.resolve import model_ref, pin

    ref = model_ref(hf_name(init_from) or "") if path is not None else None
    if ref is None:
        return path
    from dtlaunch.hub.download import ensure_model_files

    return ensure_model_files(pin(ref, path), weights=True, tokenizer=False)


def read_hf_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"model.init_from=hf:{path}: no config.json there: point it at a Hugging Face model directory "
            f"(e.g. one written by `dtlaunch ckpt export --format hf`)"
        )
    try:
        c = json.loads(cfg_file.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"model.init_from=hf:{path}: config.json is not readable JSON ({exc})") from exc
    from dtlaunch.inputs.hf_dir import check_hf_config

    check_hf_config(c, path)
    return c
