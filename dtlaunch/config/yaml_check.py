"""Read a user's YAML file (a recipe, a run's config.yaml) and say precisely what is wrong with it.

Hydra reports a broken file as "while parsing a flow sequence" without the file or the line, silently
takes the last of two duplicate keys in some places, and words an empty or non-mapping recipe as a
half sentence. This check runs first, on PyYAML's node tree (which keeps line and column of every
node), so the user reads `file, line L, column C: cause; fix`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlaunch.errors import ConfigError

# Top-level keys that hold a section of the job: `training: null` there is a mistake, not "defaults".
SECTIONS = (
    "model",
    "strategy",
    "precision",
    "training",
    "optim",
    "data",
    "checkpoint",
    "hardware",
    "launch",
    "cluster",
    "run",
    "debug",
    "profiling",
)

_HINT = "a recipe is a YAML mapping, e.g. '# @package _global_' then 'training:' and an indented 'steps: 100'"


def check_yaml_file(path: Path, what: str = "recipe") -> None:
    """Raise ConfigError naming file, line, column and cause if `path` is not a sound YAML mapping."""
    import yaml

    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")  # OSError: the CLI maps it (exit 2)
    where = f"{what} file '{path}'"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply for a config: flatten it") from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_syntax_message(where, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: YAML error: {' '.join(str(exc).split())}") from None
    if root is None:
        raise ConfigError(f"{where} is empty: {_HINT}")
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else f"the single value {_short(root.value)!r}"
        raise ConfigError(f"{where}{_at(root.start_mark)} holds {kind}, not a mapping of keys: {_HINT}")
    try:
        _check_duplicates(root, where, ())
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply for a config: flatten it") from None
    if what == "recipe" and not any(ln.strip().replace(" ", "") == "#@package_global_" for ln in text.splitlines()):
        # Without it Hydra puts the recipe's keys under `recipe:` and says "Cannot convert 'DictConfig'".
        raise ConfigError(
            f"{where} lacks the line '# @package _global_': add it as the first line (a recipe sets keys of the "
            f"whole job, e.g. 'training:', 'model:')"
        )
    for key, value in root.value:
        if key.value in SECTIONS and value.tag == "tag:yaml.org,2002:null":
            raise ConfigError(
                f"{where}{_at(key.start_mark)}: section '{key.value}' is empty (null): give it indented "
                f"keys (e.g. '{key.value}:' then '  key: value' lines) or delete the line"
            )


def _at(mark: Any) -> str:
    return f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _short(value: Any) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def _syntax_message(where: str, exc: Any) -> str:
    mark = exc.problem_mark or exc.context_mark
    problem = " ".join(str(exc.problem or "").split())
    if "'\\t'" in problem:
        cause = "a tab character; YAML indents with spaces only: replace the tabs with spaces"
    else:
        context = " ".join(str(exc.context or "").split())
        if exc.context_mark is not None and exc.problem_mark is not None and exc.context_mark != exc.problem_mark:
            context += f" (started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
        cause = f"YAML syntax error: {problem}" + (f", {context}" if context else "") + "; fix the YAML there"
    return f"{where}{_at(mark)}: {cause}"


def _check_duplicates(node: Any, where: str, path: tuple[int, ...]) -> None:
    """`path`: the nodes above this one; an alias back to one of them makes a structure that contains
    itself, which no config is (and which would recurse for ever here and in OmegaConf)."""
    import yaml

    if id(node) in path:
        raise ConfigError(f"{where}{_at(node.start_mark)}: an alias (*name) refers to a node containing it: expand it")
    path = (*path, id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, Any] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    first = seen[key.value]
                    raise ConfigError(
                        f"{where}{_at(key.start_mark)}: duplicate key '{key.value}' (first at line {first.line + 1}): "
                        f"keep one of them"
                    )
                seen[key.value] = key.start_mark
            _check_duplicates(value, where, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, where, path)
