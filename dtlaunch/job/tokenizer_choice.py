"""Which tokenizer a job uses: `data.tokenizer=auto` (the default) is the model's own.

A model loaded from `model.init_from=hf:DIR` was trained on DIR/tokenizer.json's ids; any other ids
(the byte tokenizer's, say) still fit its vocabulary and train without an error, into garbage. So `auto`
becomes that file, resolved once here by the launcher: the run's config.yaml names the file used and the
workers never guess. Without an hf: source `auto` is the built-in byte tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.config.weight_source import hf_name
from dtlaunch.hub.model_source import hf_source_dir
from dtlaunch.run.run_dir import TOKENIZER_FILE

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

AUTO = "auto"
BYTE = "byte"


def model_tokenizer_file(init_from: Any, fetch: bool = True) -> Optional[Path]:
    """DIR/tokenizer.json of model.init_from=hf:DIR when it exists, else None. For a hub name the
    tokenizer files are fetched into the cache first, unless `fetch` is false (data that needs none)."""
    path = hf_source_dir(init_from)
    if path is None:
        return None
    from dtlaunch.hub.resolve import model_ref, pin

    ref = model_ref(hf_name(init_from) or "")
    if ref is not None:
        if fetch:
            from dtlaunch.hub.download import ensure_model_files

            ensure_model_files(pin(ref, path), weights=False, tokenizer=True)
        file = path / TOKENIZER_FILE
        # Not resolve(): the cache's snapshot entries link to content-named blobs, and the tokenizer's
        # sibling files (tokenizer_config.json) are found next to this name.
        return file.absolute() if file.is_file() else None
    file = path / TOKENIZER_FILE
    return file.resolve() if file.is_file() else None


def resolve_auto_tokenizer(cfg: JobConfig) -> None:
    """Replace data.tokenizer=auto by what it means for this model, in place. Left as `auto` (validate
    refuses it, naming the fix) only when the hf: directory has no tokenizer.json and the data needs one."""
    if str(cfg.data.tokenizer) != AUTO:
        return
    own = model_tokenizer_file(cfg.model.init_from, fetch=str(cfg.data.kind) != "synthetic")
    if own is not None:
        cfg.data.tokenizer = str(own)
    elif hf_source_dir(cfg.model.init_from) is None or str(cfg.data.kind) == "synthetic":
        # No model tokenizer to honour; synthetic data is random ids and needs none either.
        cfg.data.tokenizer = BYTE


def tokenizer_problem(cfg: JobConfig) -> Optional[str]:
    """The one-line refusal for a tokenizer that contradicts the model, or None (validate's data rule)."""
    d = cfg.data
    source = hf_source_dir(cfg.model.init_from)
    if str(d.tokenizer) == AUTO and source is not None and model_tokenizer_file(cfg.model.init_from) is None:
        other = sorted(p.name for p in source.glob("tokenizer*") if p.is_file())
        found = (
            f" (it holds {', '.join(other)}: save it as tokenizer.json with transformers' AutoTokenizer)"
            if other
            else ""
        )
        return (
            f"data.tokenizer=auto: model.init_from=hf:{source} has no tokenizer.json{found}; add the model's "
            f"tokenizer.json there or set data.tokenizer to its path"
        )
    if str(d.tokenizer) == BYTE and not d.force_tokenizer:
        own = model_tokenizer_file(cfg.model.init_from, fetch=str(d.kind) != "synthetic")
        if own is not None:
            return (
                f"data.tokenizer=byte but model.init_from=hf:{source} has its own tokenizer ({own}): drop "
                f"data.tokenizer to use the model's, or set data.force_tokenizer=true to train on byte ids anyway"
            )
    return None


def effective_tokenizer(cfg: JobConfig) -> str:
    """data.tokenizer as the run will use it (`auto` read as resolve_auto_tokenizer would)."""
    spec = str(cfg.data.tokenizer)
    if spec != AUTO:
        return spec
    own = model_tokenizer_file(cfg.model.init_from)
    return str(own) if own is not None else BYTE


def shards_tokenizer_problem(cfg: JobConfig, shards_tokenizer: str) -> Optional[str]:
    """data.kind=tokens: shards prepared with the byte tokenizer for a model with its own are refused
    like data.tokenizer=byte is (their meta.json names the tokenizer they were made with)."""
    own = model_tokenizer_file(cfg.model.init_from)
    if shards_tokenizer != BYTE or own is None or cfg.data.force_tokenizer:
        return None
    return (
        f"data.path='{cfg.data.path}' was prepared with the byte tokenizer but model.init_from has its own ({own}): "
        f"re-run `dtlaunch data prepare ... --tokenizer {own}`, or set data.force_tokenizer=true to train on them"
    )
