"""Imports point down the layers and never form a cycle: every `import` in dtlaunch/, those inside functions
included (an import moved into a function hides a cycle from Python, not from a reader), read with `ast`.

LAYERS is the order, lowest first; a module belongs to the entry with the longest prefix naming it, and may
import its own layer and those below. Each entry is a whole package (or a top-level module): no package
straddles two layers, so a folder's place in the picture is its layer and no import runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dtlaunch

PACKAGE = Path(dtlaunch.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Leaves: the error classes and exit codes.
    ("leaves", ("dtlaunch", "dtlaunch.errors")),
    # The typed job: the schema (the only home of defaults), the layout arithmetic and the decisions made
    # from them; no I/O.
    ("config", ("dtlaunch.config",)),
    # Torch-free files shared by launcher and workers (environment names, checkpoint catalog, metrics).
    ("run", ("dtlaunch.run",)),
    # The readers of the files a user hands us: each owns its format's names and checks.
    ("inputs", ("dtlaunch.inputs",)),
    # Hub names to files in the cache, and an hf: source's directory.
    ("hub", ("dtlaunch.hub",)),
    ("models", ("dtlaunch.models",)),
    # Offline data preparation: tokenizers, records, shards, the sample order.
    ("data", ("dtlaunch.data",)),
    # Composing and checking a job: recipes and overrides, the model section typed by its family, the rules.
    ("job", ("dtlaunch.job",)),
    # Weights in and out, generation and evaluation.
    ("convert/infer", ("dtlaunch.convert", "dtlaunch.infer")),
    ("report", ("dtlaunch.report",)),
    # The worker's code.
    ("train", ("dtlaunch.train",)),
    # The planner sits above the worker's code: its traced second opinion runs the real step (plan.trace).
    ("plan", ("dtlaunch.plan",)),
    # Launching: the files a whole job names, the run's data, the launchers.
    ("launch", ("dtlaunch.launch",)),
    ("commands", ("dtlaunch.commands",)),
    ("cli", ("dtlaunch.cli", "dtlaunch.__main__")),
]
# The worker's code is imported by the worker alone, and by the planner's traced second opinion through
# its one entry point.
TRAIN = "dtlaunch.train"
INTO_TRAIN = {"dtlaunch.plan.trace": "dtlaunch.train.features.memory_trace"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The dtlaunch modules `name` imports anywhere in its file (`from pkg import mod` counts as mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(target: str) -> str:
        while target not in known:
            target = target.rpartition(".")[0]
        return target

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "dtlaunch"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "dtlaunch":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else owner(target))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p or (p != "dtlaunch" and module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle's path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle through the component's first module (breadth-first back to it)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return sorted(component)


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in module_files() if layer_of(m) < 0]
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"


def test_each_package_is_one_layer() -> None:
    """No module is named apart from its package: a package that straddles layers hides an upward arrow
    between folders behind a per-module exception."""
    split = [p for _, prefixes in LAYERS for p in prefixes if p.count(".") > 1]
    assert not split, f"name whole packages in LAYERS, not single modules: {split}"


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_point_down() -> None:
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports of a layer above:\n" + "\n".join(upward)


def test_only_workers_import_train() -> None:
    outside = []
    for module, targets in sorted(import_graph().items()):
        if module == TRAIN or module.startswith(TRAIN + "."):
            continue
        for target in targets:
            if (target == TRAIN or target.startswith(TRAIN + ".")) and INTO_TRAIN.get(module) != target:
                outside.append(f"{module} -> {target}")
    assert not outside, "only the workers import dtlaunch.train (plan.trace through train.memory_trace):\n" + "\n".join(
        outside
    )


def test_the_checks_see_what_they_must() -> None:
    """The graph holds imports inside functions, and the checks fail on a cycle and an upward import."""
    graph = import_graph()
    assert "dtlaunch.train.features.memory_trace" in graph["dtlaunch.plan.trace"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert layer_of("dtlaunch.cli") > layer_of("dtlaunch.commands.train") > layer_of("dtlaunch.config.schema")
    assert layer_of("dtlaunch.job.compose") > layer_of("dtlaunch.models.registry") > layer_of("dtlaunch.config.schema")
