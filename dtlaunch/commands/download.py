"""`download SOURCE...`: fetch hub models (config, weights, tokenizer) and datasets into the hub cache
ahead of time, e.g. on a login node before `submit`, so that the nodes read them offline."""

from __future__ import annotations

from typing import Sequence

from dtlaunch.commands.common import console
from dtlaunch.errors import ConfigError


def download_command(sources: Sequence[str]) -> int:
    from dtlaunch.hub.download import ensure_dataset, ensure_model_files
    from dtlaunch.hub.resolve import model_snapshot, parse_hub_name, pin

    if not sources:
        raise ConfigError("download needs a SOURCE: hf:ORG/NAME[@REVISION] (a model) or dataset:ORG/NAME[@REVISION]")
    out = console()
    for source in sources:
        kind, _, name = source.rpartition(":") if ":" in source else ("hf", "", source)
        ref = parse_hub_name(name)
        if kind not in ("hf", "dataset") or ref is None:
            raise ConfigError(
                f"download {source}: not a hub source: use hf:ORG/NAME[@REVISION] (a model) or "
                f"dataset:ORG/NAME[@REVISION]"
            )
        if kind == "hf":
            pinned = pin(ref, model_snapshot(ref, key="download"))
            path = ensure_model_files(pinned, weights=True, tokenizer=True, key="download")
            out.print(f"hf:{pinned} -> {path}", markup=False, soft_wrap=True)
        else:
            path = ensure_dataset(ref, key="download")
            out.print(f"dataset:{ref.repo}@{path.name} -> {path}", markup=False, soft_wrap=True)
    return 0
