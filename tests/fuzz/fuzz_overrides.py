"""Override sets generated from the schema: every field of JobConfig (the model section: every family's
fields) with values of its type at and past its range, of other types, choices valid and not, shell
metacharacters and newlines, typos of the key, and Hydra's own syntax misused."""

from __future__ import annotations

import dataclasses
import enum
import typing
from functools import lru_cache

from fuzz_harness import HOSTILE_TEXT
from hypothesis import strategies as st

INTS = ["-1", "0", "1", "2", "3", "4", "7", "8", "64", "-9223372036854775809", "9223372036854775808", "10**3", "1e3"]
FLOATS = ["nan", "inf", "-inf", "-0.0", "0.0", "1e308", "1e-320", "0.5", "1.0", "1.5", "-3.5", "2"]
BOOLS = ["true", "false", "maybe", "1", "0", "null"]
LISTS = ["[]", "[1,2]", "[-1]", "[a,b]", "[[1]]", "[1,", "{a: 1}", "null"]
RECIPES = ["tiny_ddp", "tiny_fsdp", "tiny_tp", "tiny_pp", "tiny_3d", "demo", "llama8b_fsdp", "nope", "../x"]
SYNTAX = ["=1", "training", "~training", "++x=1", "a==b", "[", "training.steps=[", "+model.foo=1", "model=", "-m"]


def _quoted(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


@lru_cache(maxsize=1)
def schema_fields() -> list[tuple[str, object]]:
    """(dotted key, type annotation) for every leaf field of the job schema."""
    from dtlaunch.config.schema import section_type
    from dtlaunch.job.model_schema import job_schema

    out: list[tuple[str, object]] = []

    def walk(node: type, prefix: str) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            nested = section_type(hints[f.name])
            if nested is not None:
                walk(nested, f"{prefix}{f.name}.")
            else:
                out.append((prefix + f.name, hints[f.name]))

    walk(job_schema(), "")
    return sorted(out)


def _base_types(hint: object) -> list[object]:
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return args or [hint]


def value_for(hint: object) -> st.SearchStrategy[str]:
    """Values of the field's own type (in and out of range) or of another."""
    own: list[st.SearchStrategy[str]] = []
    for t in _base_types(hint):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            own.append(st.sampled_from([str(m.value) for m in t]))
        elif t is bool:
            own.append(st.sampled_from(BOOLS))
        elif t is int:
            own.append(st.sampled_from(INTS) | st.integers(-5, 10**6).map(str))
        elif t is float:
            own.append(st.sampled_from(FLOATS) | st.floats(allow_nan=True, allow_infinity=True).map(repr))
        elif typing.get_origin(t) in (list, tuple) or t in (list, tuple):
            own.append(st.sampled_from(LISTS))
        else:
            own.append(st.sampled_from(["x", "abc", "/nonexistent/path", "auto", "byte", "random", "hf:"]))
    hostile = st.sampled_from(HOSTILE_TEXT).map(lambda s: st.sampled_from([s, _quoted(s)])).flatmap(lambda x: x)
    other = st.sampled_from(INTS + FLOATS + BOOLS + LISTS)
    return st.one_of(*own, *own, hostile, other)


def _typo(key: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, len(key) - 1), label="typo at")
    return key[:i] + data.draw(st.sampled_from("xqz_."), label="typo") + key[i + 1 :]


def override_set(data: st.DataObject) -> list[str]:
    """One to four overrides; often a recipe first, so that cross-field rules (layouts, batches) bite."""
    fields = schema_fields()
    out = []
    if data.draw(st.booleans(), label="recipe?"):
        out.append(f"recipe={data.draw(st.sampled_from(RECIPES), label='recipe')}")
    for _ in range(data.draw(st.integers(1, 4), label="overrides")):
        key, hint = data.draw(st.sampled_from(fields), label="field")
        how = data.draw(st.sampled_from(["value"] * 8 + ["typo", "add", "delete", "syntax"]), label="how")
        if how == "typo":
            key = _typo(key, data)
        if how == "delete":
            out.append(f"~{key}")
        elif how == "syntax":
            out.append(data.draw(st.sampled_from(SYNTAX), label="syntax"))
        else:
            out.append(f"{'+' if how == 'add' else ''}{key}={data.draw(value_for(hint), label='value')}")
    return out
