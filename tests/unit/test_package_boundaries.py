"""No private name crosses a package boundary (CONTRIBUTING): a module imports `_name` only from its own
package of dtlaunch (config, launch, train, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

import dtlaunch

ROOT = Path(dtlaunch.__file__).parent


def private_imports_across_packages() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        own = parts[0] if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtlaunch.")):
                continue
            package = node.module.split(".")[1]
            found += [
                f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and package != own
            ]
    return found


def test_no_private_name_crosses_a_package_boundary() -> None:
    assert private_imports_across_packages() == []
