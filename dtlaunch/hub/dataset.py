"""`data.kind=hf data.path=ORG/NAME` (and `data.val_path=ORG/NAME`): a hub dataset, downloaded whole into the hub cache by the launcher,
pinned to its commit in config.yaml (data.revision), then read by datasets.load_dataset from that
snapshot (data.subset = its configuration name, data.split) and tokenized once into the token cache like
local files. Not streamed: the repository's files must fit the cache's disk (see docs/hub.md).
data.val_path is pinned the same way, in data.val_revision; both read data.subset.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dtlaunch.hub.resolve import HubRef, parse_hub_name

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# The key naming each source, and the key holding its revision.
REVISION_KEYS = {"data.path": "revision", "data.val_path": "val_revision"}


def dataset_ref(cfg: JobConfig, path: str, key: str = "data.path") -> Optional[HubRef]:
    """The hub name `key` (data.path or data.val_path) gives, with its revision (data.revision,
    data.val_revision), or None for a local source (which wins)."""
    if not path or str(cfg.data.kind) != "hf" or Path(path).expanduser().exists() or "@" in path:
        return None
    ref = parse_hub_name(path)
    return None if ref is None else HubRef(ref.repo, str(getattr(cfg.data, REVISION_KEYS[key], "")))


def hub_dataset_refs(cfg: JobConfig) -> dict[str, HubRef]:
    """{key: hub name} for data.path and data.val_path, those that name hub datasets."""
    refs = {key: dataset_ref(cfg, str(getattr(cfg.data, key.split(".")[1], "")), key) for key in REVISION_KEYS}
    return {key: ref for key, ref in refs.items() if ref is not None}


def pin_dataset(cfg: JobConfig) -> None:
    """Fetch the hub datasets (once; a pinned one already cached costs nothing) and record their commits in
    data.revision / data.val_revision, before the run's config.yaml is written."""
    from dtlaunch.hub.download import ensure_dataset

    for key, ref in hub_dataset_refs(cfg).items():
        setattr(cfg.data, REVISION_KEYS[key], ensure_dataset(ref, key).name)


def local_source(cfg: JobConfig, path: str, key: str = "data.path") -> tuple[str, Optional[str]]:
    """(directory to read, subset) for `key`: a hub dataset's pinned snapshot and data.subset, or the path
    itself and None (a local source, read as before)."""
    ref = dataset_ref(cfg, path, key)
    if ref is None:
        return path, None
    from dtlaunch.hub.download import ensure_dataset

    return str(ensure_dataset(ref, key)), str(cfg.data.subset)
