"""The per-test time budget: no test of the last full `make test` (tests/durations.json) took over 60 s
without `@pytest.mark.slow_reason("why")`; and the checker and the durations plugin on synthetic data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from durations_report import BUDGET_S, layer_of, over_budget, slow_reason_declared, stored_durations

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "tests" / "durations.json"


def test_no_test_over_budget_without_a_reason() -> None:
    if not STORED.is_file():
        pytest.skip("no tests/durations.json yet: `make test` writes it (CONTRIBUTING.md, *Test time*)")
    late = over_budget(stored_durations(STORED), ROOT)
    assert not late, (
        f"over {BUDGET_S:.0f} s in the last full run (tests/durations.json), without "
        "@pytest.mark.slow_reason('why'): make them cheaper, or mark them and say why:\n  " + "\n  ".join(late)
    )


SOURCE = textwrap.dedent(
    """
    import pytest

    def test_plain():
        pass

    @pytest.mark.slow_reason("trains 2 ranks for 40 steps")
    def test_marked():
        pass

    @pytest.mark.slow_reason("")
    def test_empty_reason():
        pass

    @pytest.mark.parametrize("n", [1, 2])
    @pytest.mark.slow_reason(reason="one sweep per size")
    def test_param(n):
        pass

    @pytest.mark.slow_reason("the class shares one run")
    class TestShared:
        def test_a(self):
            pass

    class TestOther:
        pytestmark = [pytest.mark.slow_reason("a forked sweep")]

        def test_b(self):
            pass

    class TestNone:
        def test_c(self):
            pass
    """
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("test_plain", False),
        ("test_marked", True),
        ("test_empty_reason", False),  # the reason is the point
        ("test_param[2]", True),
        ("TestShared::test_a", True),
        ("TestOther::test_b", True),
        ("TestNone::test_c", False),
        ("test_gone", None),  # removed since the stored run
        ("TestNone::test_gone", None),
    ],
)
def test_slow_reason_found_on_function_class_or_not(name: str, expected: bool | None) -> None:
    assert slow_reason_declared(SOURCE, f"tests/e2e/test_x.py::{name}") is expected


def test_over_budget_names_only_slow_unmarked_existing_tests(tmp_path: Path) -> None:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "tests" / "e2e" / "test_x.py").write_text(SOURCE)
    (tmp_path / "tests" / "e2e" / "test_module.py").write_text(
        "import pytest\npytestmark = pytest.mark.slow_reason('one module-scoped run')\ndef test_m():\n    pass\n"
    )
    durations = {
        "tests/e2e/test_x.py::test_plain": 61.0,
        "tests/e2e/test_x.py::TestNone::test_c": 300.0,
        "tests/e2e/test_x.py::test_marked": 500.0,
        "tests/e2e/test_x.py::test_param[1]": 90.0,
        "tests/e2e/test_x.py::test_empty_reason": 59.9,  # under the budget: no reason needed
        "tests/e2e/test_x.py::test_gone": 100.0,
        "tests/e2e/test_module.py::test_m": 100.0,
        "tests/e2e/test_deleted.py::test_z": 100.0,
    }
    assert over_budget(durations, tmp_path) == [
        "tests/e2e/test_x.py::TestNone::test_c (300 s)",
        "tests/e2e/test_x.py::test_plain (61 s)",
    ]
    assert over_budget(durations, tmp_path, budget_s=1000) == []


def test_layer_of() -> None:
    assert layer_of("tests/unit/test_a.py::test_b[1]") == "unit"
    assert layer_of("tests/e2e/sub/test_a.py::T::test_b") == "e2e"


def test_plugin_stores_layers_and_summarises(tmp_path: Path) -> None:
    """The plugin in a real pytest session (a subprocess: a session inside this one would share its plugins):
    it writes the layers it ran, keeps the other layers and sessions already stored, and prints the summary."""
    tests = tmp_path / "tests" / "unit"
    tests.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    (tmp_path / "tests" / "conftest.py").write_text(conftest)
    (tmp_path / "tests" / "durations_report.py").write_text((ROOT / "tests" / "durations_report.py").read_text())
    (tests / "test_t.py").write_text(
        "import time, pytest\n"
        "def test_fast():\n    pass\n"
        "def test_sleeps():\n    time.sleep(0.3)\n"
        "def test_fails():\n    assert False\n"
    )
    store = tmp_path / "durations.json"
    store.write_text(
        json.dumps(
            {
                "layers": {"e2e": {"tests": 1, "sum_s": 2000.0, "durations": {"tests/e2e/test_e.py::test_e": 2000.0}}},
                "sessions": {"e2e": {"wall_s": 2000.0}, "unit": {"wall_s": 5.0}},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations-file", str(store), "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        # Without the installed plugins (hypothesis, xdist, ...): seconds of start-up this test does not need.
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failing test's, not the plugin's
    data = json.loads(store.read_text())
    unit = data["layers"]["unit"]["durations"]
    assert set(unit) == {f"tests/unit/test_t.py::{n}" for n in ("test_fast", "test_sleeps", "test_fails")}
    assert unit["tests/unit/test_t.py::test_sleeps"] >= 0.3
    assert data["layers"]["e2e"]["durations"] == {"tests/e2e/test_e.py::test_e": 2000.0}
    assert set(data["sessions"]) == {"e2e", "unit"} and data["sessions"]["unit"]["wall_s"] < 100
    out = proc.stdout
    assert "test durations" in out and "unit: 3 tests" in out
    assert out.index("test_sleeps") < out.index("test_fast")  # slowest first
    assert "OVER the 30.0 min goal" in out
    # the e2e test over budget is not this session's: the summary names only the tests it ran
    assert "test_e.py" not in out


def test_two_sessions_at_once_split_a_layer_and_count_their_wall_once(tmp_path: Path) -> None:
    """`make test` runs the single-process and multi-process sessions side by side, both holding e2e files:
    each replaces only its own files' tests, and the stored wall time is the union of their spans."""
    from durations_report import merge, sessions_wall

    for f in ("a", "b"):
        (tmp_path / "tests" / "e2e").mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / "e2e" / f"test_{f}.py").write_text("")
    data: dict = {
        "layers": {"e2e": {"durations": {"tests/e2e/test_a.py::t": 9.0, "tests/e2e/test_gone.py::t": 5.0}}},
        "sessions": {"distributed+e2e": {"wall_s": 100.0}},
    }
    merge(data, {"e2e": {"tests/e2e/test_a.py::t": 1.0}}, "multi", 1000.0, 600.0, 0, 0, tmp_path)
    merge(data, {"e2e": {"tests/e2e/test_b.py::t": 2.0}, "unit": {"x": 1.0}}, "single", 1010.0, 400.0, 0, 0, tmp_path)
    e2e = data["layers"]["e2e"]
    assert e2e["durations"] == {"tests/e2e/test_a.py::t": 1.0, "tests/e2e/test_b.py::t": 2.0} and e2e["sum_s"] == 3.0
    assert set(data["sessions"]) == {"multi", "single"}  # the older e2e session went, the concurrent one stayed
    assert sessions_wall(data["sessions"]) == 600.0
    data["sessions"]["later"] = {"began_epoch": 2000.0, "ended_epoch": 2050.0, "wall_s": 50.0}
    assert sessions_wall(data["sessions"]) == 650.0


def test_a_session_from_an_earlier_run_is_named_not_added(tmp_path: Path) -> None:
    """`make test`'s first session to end prints before the other has stored its times: the other's stored entry
    is an earlier run's, named but not added to this run's wall time (CI once printed 22.0 + 21.8 = 43.7 min
    "OVER" for a make test of 22.5 min)."""
    from durations_report import report_lines

    data = {
        "sessions": {
            "single": {"began_epoch": 0.0, "ended_epoch": 1300.0, "wall_s": 1300.0},
            "multi": {"began_epoch": 5000.0, "ended_epoch": 6320.0, "wall_s": 1320.0},
        }
    }
    line = next(x for x in report_lines(data, {}, "multi", 1320.0, False, tmp_path) if x.startswith("stored"))
    assert "multi 22.0 min; 22.0 min of wall time" in line and "within" in line, line
    assert line.endswith("not counted, from an earlier run: single"), line
    data["sessions"]["single"] = {"began_epoch": 5000.0, "ended_epoch": 6310.0, "wall_s": 1310.0}
    line = next(x for x in report_lines(data, {}, "multi", 1320.0, False, tmp_path) if x.startswith("stored"))
    assert "22.0 min of wall time" in line and "earlier" not in line, line
