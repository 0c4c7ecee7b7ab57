"""`model.init_from=hf:DIR`: the model section comes from DIR/config.json (torch-free, weights unread).

`architectures` picks the registry entry; every size is read from config.json and replaces the
recipe's model group. A command-line override of a model field that contradicts config.json is an
error naming both values (silently training another shape than the weights would fail later, or
worse, load into a model the checkpoint does not describe).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError
from dtlaunch.hub.model_source import hf_source_dir, read_hf_config

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def model_fields_from_hf(path: Path, config: Optional[dict] = None, arch: str = "") -> dict:
    """The model section's fields described by DIR/config.json (arch included)."""
    from dtlaunch.inputs.hf_dir import check_hf_dir
    from dtlaunch.models.registry import spec_for_hf

    c = config if config is not None else read_hf_config(path)
    # The sizes config.json gives, and the layers and vocabulary its weights hold, before any is used.
    check_hf_dir(path, c)
    where = f"model.init_from=hf:{path}"
    if arch == "hf_auto":
        return _generic_fields(c, where)
    spec = spec_for_hf(list(c.get("architectures") or []), where)
    try:
        fields = spec.hf.config_from_hf(c, where)
    except KeyError as exc:
        raise ConfigError(f"{where}: config.json has no {exc.args[0]}: it does not describe a model") from exc
    except (TypeError, ValueError) as exc:  # int(None), float([...]): a value of the wrong type
        raise ConfigError(f"{where}: config.json holds a value of the wrong type ({exc}): restore it") from None
    fields["arch"] = spec.arch
    return fields


def _generic_fields(c: dict, where: str) -> dict:
    """model.arch=hf_auto: the sizes the planner and summary show, read from the usual config.json keys
    (transformers builds the model itself from the whole file)."""
    try:
        dim, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        vocab = int(c["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: config.json lacks {exc} that model.arch=hf_auto reads") from exc
    return {
        "arch": "hf_auto",
        "dim": dim,
        "n_layers": layers,
        "n_heads": heads,
        "n_kv_heads": int(c.get("num_key_value_heads") or heads),
        "vocab_size": vocab,
        "max_seq_len": int(c.get("max_position_embeddings") or 2048),
    }


def _cli_model_keys(overrides: Sequence[str]) -> set[str]:
    """Dotted paths under `model.` the command line sets (e.g. 'dim', 'moe.aux_loss_coef')."""
    return {m.group(1) for ov in overrides if (m := re.match(r"\+{0,2}model\.([\w.]+)=", ov))}


def training_choices(schema: type, prefix: str = "") -> set[str]:
    """Dotted paths of a model schema's fields marked TRAINING_CHOICE: the user may still set them with
    an hf: source, since they do not describe the weights (the name, the sequence length, balancing)."""
    import dataclasses
    import typing

    from dtlaunch.config.schema import section_type

    found: set[str] = set()
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.metadata.get("training_choice"):
            found.add(prefix + f.name)
        nested = section_type(hints[f.name])
        if nested is not None:
            found |= training_choices(nested, f"{prefix}{f.name}.")
    return found


_ABSENT = object()


def _dig(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _put(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def apply_hf_model(resolved: dict, overrides: Sequence[str]) -> None:
    """Replace resolved['model'] by what DIR/config.json describes; conflicting overrides are errors."""
    from dtlaunch.job.model_schema import family_schema

    model = resolved.get("model") or {}
    path = hf_source_dir(model.get("init_from"))
    if path is None:
        return
    given = _cli_model_keys(overrides)
    fields = model_fields_from_hf(path, arch="hf_auto" if "arch" in given and model.get("arch") == "hf_auto" else "")
    free = training_choices(family_schema(fields))
    for key in sorted(given - free):
        ours, theirs = _dig(model, key), _dig(fields, key)
        if theirs is not _ABSENT and _differs(ours, theirs):
            raise ConfigError(
                f"model.{key}={ours} contradicts {path}/config.json ({key.rpartition('.')[2]}={theirs}): "
                f"drop the override, the model comes from model.init_from"
            )
    # Fields config.json does not describe go back to their defaults (not the recipe's model group).
    init_from = _pinned(str(model["init_from"]), path)
    name = path.name if init_from == model["init_from"] else init_from.partition("@")[0].rpartition("/")[2]
    new = {"name": name, "init_from": init_from, **fields}
    for key in sorted(given & free - {"init_from"}):  # init_from stays pinned to its commit
        _put(new, key, _dig(model, key))
    resolved["model"] = new


def _pinned(init_from: str, path: Path) -> str:
    """hf:ORG/NAME[@REV] as hf:ORG/NAME@<commit> (what config.yaml records: a resume or another node
    reads the same files); a local directory as given."""
    from dtlaunch.hub.resolve import model_ref, pin

    ref = model_ref(hf_name(init_from) or "")
    return init_from if ref is None else f"hf:{pin(ref, path)}"


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) > 1e-12 * max(1.0, abs(float(b)))
        except (TypeError, ValueError):
            return True
    return a != b


def describe_hf_source(cfg: JobConfig) -> Optional[str]:
    """One line saying what model.init_from=hf:DIR loads (architecture, parameters, dtype, source)."""
    path = hf_source_dir(cfg.model.init_from)
    if path is None:
        return None
    from dtlaunch.models.registry import model_spec
    from dtlaunch.models.shapes import param_count

    c = read_hf_config(path)
    arch = ", ".join(c.get("architectures") or [])
    dtype = c.get("torch_dtype") or c.get("dtype") or "unknown dtype"
    # What of the directory the family reads, where not all of it (Qwen3.5's text decoder of a multimodal model).
    note = getattr(model_spec(cfg.model).hf, "source_note", None)
    return (
        f"loaded {arch} (model.arch={cfg.model.arch}) from {path}: {param_count(cfg.model):,} parameters, "
        f"{dtype} weights{note(c) if note else ''}"
    )
