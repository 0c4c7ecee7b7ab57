"""Shell completion of command-line overrides: recipe names, config-group options (`model=<TAB>`) and
schema keys (`training.<TAB>`). Read from the package's files and the schema's dataclasses only (no
Hydra, no torch): a completion runs on every TAB press and must answer at once."""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Any, Optional


def _section(dotted: str) -> Optional[type]:
    """The schema dataclass at `dotted` ('' = the job), or None if that is not a section."""
    from dtlaunch.config.schema import section_type
    from dtlaunch.job.model_schema import job_schema

    node: Any = job_schema()
    for part in [p for p in dotted.split(".") if p]:
        hint = typing.get_type_hints(node).get(part)
        node = section_type(hint)  # Optional[X] and plain X alike
        if node is None:
            return None
    return node


def _keys_under(parent: str) -> list[str]:
    """`parent.field=` for values and `parent.section.` for nested sections."""
    from dtlaunch.config.schema import section_type

    node = _section(parent)
    if node is None:
        return []
    hints = typing.get_type_hints(node)
    out = []
    for f in fields(node):
        nested = section_type(hints[f.name])
        key = f"{parent}.{f.name}" if parent else f.name
        out.append(f"{key}." if nested is not None else f"{key}=")
    return out


def _value_options(key: str) -> list[str]:
    from dtlaunch.job.compose import CONFIGS_DIR, group_options, list_recipes

    if key == "recipe":
        try:
            return list(list_recipes())
        except Exception:  # a bad $DTLAUNCH_RECIPE_PATH: no completions rather than an error mid-typing
            return []
    if (CONFIGS_DIR / key).is_dir():
        return group_options(key)
    parent, _, leaf = key.rpartition(".")
    node = _section(parent)
    if node is not None and typing.get_type_hints(node).get(leaf) is bool:
        return ["true", "false"]
    return []


def complete_override(incomplete: str) -> list[str]:
    """Completions of one override word as typed so far."""
    from dtlaunch.job.compose import CONFIGS_DIR

    sign = incomplete[:1] if incomplete[:1] in "+~" else ""
    body = incomplete[len(sign) :]
    if "=" in body:
        key, _, value = body.partition("=")
        return [f"{sign}{key}={o}" for o in _value_options(key) if o.startswith(value)]
    if "." in body:
        parent = body.rpartition(".")[0]
        candidates = _keys_under(parent)
    else:
        groups = sorted(p.name for p in CONFIGS_DIR.iterdir() if p.is_dir())
        candidates = ["recipe=", *(f"{g}=" for g in groups), *_keys_under("")]
    return sorted({f"{sign}{c}" for c in candidates if c.startswith(body)})


def complete_words(args: list[str], incomplete: str) -> list[str]:
    """Completions given the words before the cursor too. Bash splits `model=lla` at '=' (it is in
    COMP_WORDBREAKS), so there the current word is `lla` (or `=` itself) and the key precedes it;
    the reply then replaces only that word."""
    # Click turns a lone "=" current word into "": a bare key before the cursor means it was "=".
    if incomplete in ("=", "") and args and "=" not in args[-1] and _value_options(args[-1]):
        return [f"={o}" for o in _value_options(args[-1])]
    if len(args) >= 2 and args[-1] == "=":
        return [o for o in _value_options(args[-2]) if o.startswith(incomplete)]
    return complete_override(incomplete)
