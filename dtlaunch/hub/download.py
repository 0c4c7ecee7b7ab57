"""Fetch what a job needs from the hub into its cache, once, with a progress bar.

Planning needs config.json only (dtlaunch.hub.resolve); the weights come here when training, exporting
or generating needs them, the tokenizer when the data does. One process per cache downloads while the
others wait on a lock beside the repository's files (nodes sharing a cache fetch it once), and a failed
download leaves no partial file behind: huggingface_hub writes each file under a temporary name, which
is removed on failure, so a later run never trusts half a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import InputError
from dtlaunch.hub.errors import hub_module, translate
from dtlaunch.hub.resolve import HubRef, snapshot_path
from dtlaunch.inputs.hf_dir import INDEX_FILE, weight_files
from dtlaunch.run.run_dir import TOKENIZER_FILE

# model*.safetensors, not *.safetensors: some repositories also hold the same weights in another layout
# (consolidated.safetensors), which would double the download for nothing dtlaunch reads.
WEIGHT_PATTERNS = ["model*.safetensors", INDEX_FILE, "config.json", "generation_config.json"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "chat_template.jinja", "config.json"]


def weights_complete(snapshot: Path) -> bool:
    """Every safetensors file the model consists of is in the snapshot (read from its index if sharded)."""
    try:
        files = weight_files(snapshot)
    except InputError:  # an index not (yet) whole: fetch again
        return False
    return bool(files) and all((snapshot / f).is_file() for f in files)


def ensure_model_files(ref: HubRef, weights: bool, tokenizer: bool, key: str = "model.init_from") -> Path:
    """The pinned snapshot of a model holding its weights and/or tokenizer files (fetched if missing)."""
    snapshot = snapshot_path(ref)

    def present() -> bool:
        return (not weights or weights_complete(snapshot)) and (not tokenizer or (snapshot / TOKENIZER_FILE).is_file())

    if present():
        return snapshot
    patterns = (WEIGHT_PATTERNS if weights else []) + (TOKENIZER_PATTERNS if tokenizer else [])
    return Path(fetch(ref, "model", sorted(set(patterns)), key, present))


def ensure_dataset(ref: HubRef, key: str = "data.path") -> Path:
    """The snapshot of a dataset repository (all its files). A pinned revision whose file listing the
    cache already holds costs no request."""
    return Path(fetch(ref, "dataset", None, key, lambda: False))


def fetch(ref: HubRef, repo_type: str, patterns: Sequence[str] | None, key: str, present: Callable[[], bool]) -> str:
    """snapshot_download under a per-repository lock; partial files removed when it fails."""
    hub = hub_module()
    from filelock import FileLock
    from huggingface_hub import constants

    name = hub.file_download.repo_folder_name(repo_id=ref.repo, repo_type=repo_type)
    folder = Path(constants.HF_HUB_CACHE) / name
    # Beside huggingface_hub's own per-file locks (HF_HUB_CACHE/.locks/<repo>), one for the whole fetch.
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / name / "dtlaunch-download.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if present():  # another process (node) fetched it while this one waited
            return str(snapshot_path(ref, repo_type))
        try:
            return hub.snapshot_download(
                ref.repo, repo_type=repo_type, revision=ref.revision or None, allow_patterns=patterns
            )
        except BaseException as exc:
            _remove_partial(folder)  # only dtlaunch writes here now: it holds the lock
            if isinstance(exc, Exception):
                name = f"hf:{ref}" if repo_type == "model" else str(ref)
                raise translate(exc, key, name, repo_type) from None
            raise


def _remove_partial(folder: Path) -> None:
    """Files huggingface_hub was still writing (blobs/*.incomplete): never resumed from, never trusted."""
    for part in (folder / "blobs").glob("*.incomplete"):
        part.unlink(missing_ok=True)


def check_cached(cfg: object) -> None:
    """`submit`: a hub model's weights (pinned in config.yaml) must already be in the cache the nodes read,
    so they never download at once: refused otherwise, naming the `dtlaunch download` to run."""
    from dtlaunch.hub.resolve import model_ref

    source = str(cfg.model.init_from)  # type: ignore[attr-defined]
    name = hf_name(source)
    ref = model_ref(name) if name is not None else None
    if ref is None or weights_complete(snapshot_path(ref)):
        return
    from huggingface_hub import constants

    raise InputError(
        f"model.init_from={source}: its weights are not in the hub cache ({constants.HF_HUB_CACHE}): run "
        f"`dtlaunch download hf:{ref.repo}@{ref.revision}` first, with the HF_HOME / HF_HUB_CACHE the nodes use"
    )
