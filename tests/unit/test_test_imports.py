"""Test modules import their neighbours the way pytest puts them on the path (tests/ for the shared helpers,
a test's own folder for its neighbours), never as `tests.x`: that works only where the checkout itself is on
sys.path (PYTHONPATH=., an IDE), not under `make test`, where such a file fails to collect."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_module_imports_the_tests_package() -> None:
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [
                f"{path.relative_to(TESTS)}:{node.lineno}: {n}" for n in names if n == "tests" or n.startswith("tests.")
            ]
    assert not bad, "import the helper by its own name (e.g. `from cli_in_process import ...`):\n" + "\n".join(bad)
