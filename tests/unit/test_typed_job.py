"""The resolved job flows as a type: a parameter named `cfg` is annotated JobConfig (an OmegaConf node typed by
dtlaunch.config.schema.JobConfig), never `Any`, and every schema name an annotation uses is imported where it is
used. The imports sit under `if TYPE_CHECKING:` (the files use `from __future__ import annotations`), so a wrong
or missing one costs nothing at runtime and nothing else would notice it: these checks read the source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import dtlaunch
from dtlaunch.config import schema

PACKAGE = Path(dtlaunch.__file__).parent
ROOT = PACKAGE.parent
# The schema's dataclasses (JobConfig and its sections), the names annotations take from it.
SCHEMA_TYPES = {n for n, v in vars(schema).items() if dataclasses.is_dataclass(v) and v.__module__ == schema.__name__}
UNTYPED = {"Any", "Optional[Any]", "Any | None", "Union[Any, None]"}


@functools.cache  # parsed once for the three checks
def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(f.relative_to(ROOT)), ast.parse(f.read_text(), str(f))) for f in sorted(PACKAGE.rglob("*.py"))]


def untyped_cfg_params(tree: ast.Module) -> list[str]:
    """`name:line` of every parameter named cfg annotated Any (or Optional[Any])."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if arg.arg == "cfg" and arg.annotation is not None and ast.unparse(arg.annotation) in UNTYPED:
                    found.append(f"{getattr(node, 'name', 'lambda')}:{arg.lineno}")
    return found


def _type_checking_blocks(tree: ast.Module) -> list[ast.If]:
    return [
        s
        for s in tree.body
        if isinstance(s, ast.If) and ast.unparse(s.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    ]


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level: imports (those under TYPE_CHECKING included), classes, functions, assignments."""
    names: set[str] = set()
    for stmt in tree.body:
        for s in [stmt, *(stmt.body if isinstance(stmt, ast.If) else [])]:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in s.names}
            elif isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(s.name)
            elif isinstance(s, (ast.Assign, ast.AnnAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _annotation_names(tree: ast.Module) -> dict[str, int]:
    """Schema type names used in annotations (parameters, returns, class fields) -> first line."""
    anns: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            args = (*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x))
            anns += [x.annotation for x in args if x.annotation is not None]
            anns += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
    used: dict[str, int] = {}
    for ann in anns:
        for n in ast.walk(ann):
            if isinstance(n, ast.Name) and n.id in SCHEMA_TYPES:
                used.setdefault(n.id, n.lineno)
    return used


def test_no_cfg_annotated_any():
    bad = [f"{path}:{where}" for path, tree in _sources() for where in untyped_cfg_params(tree)]
    assert not bad, (
        "a parameter named cfg is annotated Any; annotate it JobConfig (`if TYPE_CHECKING: from "
        f"dtlaunch.config.schema import JobConfig`), or name it for what it is: {bad}"
    )


def test_the_check_finds_an_untyped_cfg():
    src = "from typing import Any, Optional\ndef f(x: int, cfg: Any): ...\ndef g(*, cfg: Optional[Any] = None): ...\n"
    assert untyped_cfg_params(ast.parse(src)) == ["f:2", "g:3"]
    assert untyped_cfg_params(ast.parse("def f(cfg: JobConfig, m: Any): ...")) == []


def test_type_checking_imports_of_the_schema_resolve():
    imported = 0
    for path, tree in _sources():
        for block in _type_checking_blocks(tree):
            for s in block.body:
                if isinstance(s, ast.ImportFrom) and s.module == schema.__name__:
                    missing = [a.name for a in s.names if not hasattr(schema, a.name)]
                    assert not missing, f"{path}:{s.lineno} imports {missing} from {schema.__name__}, which has none"
                    imported += len(s.names)
    assert imported > 90  # the job's type is imported where it flows (about one import a file)


def test_schema_names_in_annotations_are_imported():
    bad = []
    for path, tree in _sources():
        bound = _module_names(tree)
        bad += [f"{path}:{line} {name}" for name, line in _annotation_names(tree).items() if name not in bound]
    assert not bad, f"an annotation names a schema type the module does not import (under TYPE_CHECKING): {bad}"
