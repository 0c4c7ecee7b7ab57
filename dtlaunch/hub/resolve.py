"""Hub names to snapshot directories in the huggingface_hub cache (HF_HUB_CACHE / HF_HOME).

`ORG/NAME[@REVISION]` names a repository; the revision (a branch, tag or commit, default main) is
resolved once by the launcher to its commit hash, and the run's config.yaml records `ORG/NAME@<hash>`:
a resume or another node then reads exactly the same files, from the cache, without asking the hub.
Resolving a model fetches config.json only (planning a 70B model needs no weights); the weights and the
tokenizer come later, when something needs them (dtlaunch.hub.download).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dtlaunch.hub.errors import hub_module, translate

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str  # "" = the hub's default branch

    @property
    def pinned(self) -> bool:
        return bool(_COMMIT.match(self.revision))

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


def parse_hub_name(text: str) -> Optional[HubRef]:
    """ORG/NAME[@REVISION] as a HubRef, or None when `text` does not look like a hub name."""
    if not _NAME.match(text) or text.startswith((".", "~")):
        return None
    repo, _, revision = text.partition("@")
    return HubRef(repo, revision)


def model_ref(source: str) -> Optional[HubRef]:
    """The hub name in `hf:SOURCE`, or None when SOURCE is a local path (an existing directory wins)."""
    if Path(source).expanduser().exists():
        return None
    return parse_hub_name(source)


def snapshot_path(ref: HubRef, repo_type: str = "model") -> Path:
    """Where the cache keeps a pinned revision's files (it may not exist yet)."""
    hub = hub_module()
    from huggingface_hub import constants

    folder = hub.file_download.repo_folder_name(repo_id=ref.repo, repo_type=repo_type)
    return Path(constants.HF_HUB_CACHE) / folder / "snapshots" / ref.revision


_RESOLVED: dict[str, Path] = {}


def model_snapshot(ref: HubRef, key: str = "model.init_from") -> Path:
    """The snapshot directory of a model, holding at least its config.json (fetched now if missing).

    A pinned revision already in the cache costs no request; otherwise one metadata request and, the
    first time, config.json itself. HF_TOKEN and HF_HUB_OFFLINE=1 are honoured by huggingface_hub."""
    if str(ref) in _RESOLVED:
        return _RESOLVED[str(ref)]
    hub = hub_module()
    try:
        config = hub.hf_hub_download(ref.repo, "config.json", revision=ref.revision or None)
    except Exception as exc:  # translate() re-raises what it does not recognise
        raise translate(exc, key, f"hf:{ref}") from None
    snapshot = Path(config).parent
    _RESOLVED[str(ref)] = snapshot
    return snapshot


def pin(ref: HubRef, snapshot: Path) -> HubRef:
    """The same name pinned to the commit the snapshot directory holds."""
    return HubRef(ref.repo, snapshot.name)
