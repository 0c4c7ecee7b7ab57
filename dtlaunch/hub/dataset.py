"""`data.kind=hf data.path=ORG/NAME`: a hub dataset, downloaded whole into the hub cache by the launcher,
pinned to its commit in config.yaml (data.revision), then read by datasets.load_dataset from that
snapshot (data.subset = its configuration name, data.split) and tokenized once into the token cache like
local files. Not streamed: the repository's files must fit the cache's disk (see docs/hub.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dtlaunch.hub.resolve import HubRef, parse_hub_name


def dataset_ref(cfg: Any, path: str) -> Optional[HubRef]:
    """The hub name data.path gives (with data.revision), or None for a local source (which wins)."""
    if str(cfg.data.kind) != "hf" or Path(path).expanduser().exists() or "@" in path:
        return None
    ref = parse_hub_name(path)
    return None if ref is None else HubRef(ref.repo, str(cfg.data.revision))


def pin_dataset(cfg: Any) -> None:
    """Fetch a hub dataset (once; a pinned one already cached costs nothing) and record its commit in
    data.revision, before the run's config.yaml is written."""
    ref = dataset_ref(cfg, str(cfg.data.path))
    if ref is None:
        return
    from dtlaunch.hub.download import ensure_dataset

    cfg.data.revision = ensure_dataset(ref).name


def local_source(cfg: Any, path: str) -> tuple[str, Optional[str]]:
    """(directory to read, subset) for data.path: a hub dataset's pinned snapshot and data.subset, or the
    path itself and None (a local source, read as before)."""
    ref = dataset_ref(cfg, path)
    if ref is None:
        return path, None
    from dtlaunch.hub.download import ensure_dataset

    return str(ensure_dataset(ref)), str(cfg.data.subset)
