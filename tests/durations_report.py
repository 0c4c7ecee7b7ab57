"""Where the suite's time goes, and the per-test budget (CONTRIBUTING: *Test time*).

A pytest plugin (registered by tests/conftest.py) that, given `--durations-file PATH` (`make test` passes
tests/durations.json), adds up every test's setup + call + teardown seconds, replaces the layers this session
ran (unit, fuzz, distributed, e2e, system: the folder under tests/) in PATH, and prints per layer the slowest
tests, the layer's sum and the session's wall time, and the total of the stored sessions against the suite's
30-minute goal. Under pytest-xdist the controller receives every worker's reports, so it is the one that
writes. Nothing here may fail a run: an error in the plugin is one warning line in the summary.

`over_budget` is the budget check tests/unit/test_durations_budget.py runs on the stored file: a test above
BUDGET_S seconds needs `@pytest.mark.slow_reason("why")` on its function, its class or its module
(`pytestmark`), found in the source with `ast` (no collection: the unit layer does not import the others).
A module-scoped fixture's setup counts on the first test that uses it, so a file sharing one slow run across
its tests marks the module.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

BUDGET_S = 60.0
GOAL_S = 30 * 60.0  # the whole of `make test`, issue #49
TOP = 10


def layer_of(nodeid: str) -> str:
    """'tests/unit/test_x.py::test_a' -> 'unit' (the folder under tests/; a rootdir elsewhere: the first)."""
    parts = nodeid.split("::")[0].split("/")
    if len(parts) > 2 and parts[0] == "tests":
        return parts[1]
    return parts[0] if len(parts) > 1 else "."


# --- the budget check ---------------------------------------------------------------------------------------


def _is_slow_reason(node: ast.AST) -> bool:
    """`pytest.mark.slow_reason("why")` (or `mark.slow_reason(...)`) with a non-empty reason."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr != "slow_reason":
        return False
    args = [*node.args, *(k.value for k in node.keywords if k.arg == "reason")]
    return bool(args) and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) and bool(args[0].value)


def _marks(value: ast.AST) -> bool:
    """A decorator or a `pytestmark` value (one mark or a list/tuple of them) that includes slow_reason."""
    if isinstance(value, (ast.List, ast.Tuple)):
        return any(_is_slow_reason(v) for v in value.elts)
    return _is_slow_reason(value)


def _marking_pytestmark(node: ast.stmt) -> bool:
    """`pytestmark = ...slow_reason(...)` (or a list holding it), in a module or a class body."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return False
    return any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and _marks(value)


def slow_reason_declared(source: str, nodeid: str) -> Optional[bool]:
    """Whether the test `nodeid` (in the module whose text is `source`) carries slow_reason on its function,
    an enclosing class or its module; None when the module has no such test any more (the stored durations
    are older than the code)."""
    names = nodeid.split("[", 1)[0].split("::")[1:]  # a parameter id may hold "::" itself
    if not names:
        return None
    tree = ast.parse(source)
    marked = any(_marking_pytestmark(node) for node in tree.body)
    scope: list[ast.stmt] = tree.body
    for name in names:
        found = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
            ),
            None,
        )
        if found is None:
            return None
        marked = marked or any(_marks(d) for d in found.decorator_list)
        if isinstance(found, ast.ClassDef):
            scope = found.body
            marked = marked or any(_marking_pytestmark(n) for n in found.body)
    return marked


def over_budget(durations: dict[str, float], root: Path, budget_s: float = BUDGET_S) -> list[str]:
    """'nodeid (seconds)' for every test above `budget_s` without a slow_reason; tests no longer in the
    source are left out (the next `make test` drops them from the file)."""
    sources: dict[str, Optional[str]] = {}
    found = []
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1]):
        if seconds <= budget_s:
            continue
        path = nodeid.split("::")[0]
        if path not in sources:
            file = root / path
            sources[path] = file.read_text() if file.is_file() else None
        source = sources[path]
        if source is not None and slow_reason_declared(source, nodeid) is False:
            found.append(f"{nodeid} ({seconds:.0f} s)")
    return found


def stored_durations(path: Path) -> dict[str, float]:
    """Every test's seconds in a durations file, over all its layers."""
    data = json.loads(path.read_text())
    return {k: float(v) for layer in data.get("layers", {}).values() for k, v in layer.get("durations", {}).items()}


# --- the plugin ---------------------------------------------------------------------------------------------


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("dtlaunch durations")
    group.addoption(
        "--durations-file",
        default=None,
        metavar="PATH",
        help="Store every test's duration in PATH (JSON, the layers this session ran replaced) and print the "
        "slowest per layer with the totals against the 30-minute goal (make test: tests/durations.json).",
    )
    group.addoption(
        "--durations-session",
        default=None,
        metavar="NAME",
        help="The name this session's wall time is stored under (default: its layers joined by '+').",
    )


class DurationsPlugin:
    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.began = time.time()
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += float(getattr(report, "duration", 0.0) or 0.0)
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        try:
            self.lines = self._finish(session, int(exitstatus))
        except Exception as exc:  # noqa: BLE001 - timings are information: they never fail the run
            self.lines = [f"durations: not recorded ({type(exc).__name__}: {exc})"]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.lines:
            terminalreporter.section("test durations (tests/durations_report.py)")
            for line in self.lines:
                terminalreporter.write_line(line)

    def _finish(self, session: pytest.Session, exitstatus: int) -> list[str]:
        wall = time.time() - self.began
        by_layer: dict[str, dict[str, float]] = defaultdict(dict)
        for nodeid, seconds in self.seconds.items():
            by_layer[layer_of(nodeid)][nodeid] = round(seconds, 2)
        if not by_layer:
            return []
        # An interrupted or stopped session (Ctrl-C, -x) ran part of its layers: print, do not store.
        partial = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR) or bool(
            session.shouldstop or session.shouldfail
        )
        key = self.config.getoption("durations_session") or "+".join(sorted(by_layer))
        root = Path(str(self.config.rootpath))
        # `make test` runs two sessions at once (the single-process tests beside the multi-process ones), both
        # writing this file: each merges its own tests into it under a lock.
        with _locked(self.path):
            data = _load(self.path)
            if not partial:
                merge(data, by_layer, key, self.began, wall, _workers(self.config), exitstatus, root)
                try:
                    tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                    os.replace(tmp, self.path)
                except OSError as exc:  # the summary still prints
                    note = f"durations: {self.path} not written ({exc})"
                    return [*report_lines(data, by_layer, key, wall, partial, root), note]
        return report_lines(data, by_layer, key, wall, partial, root)


def merge(
    data: dict[str, Any],
    ran: dict[str, dict[str, float]],
    key: str,
    began: float,
    wall: float,
    workers: int,
    exitstatus: int,
    root: Path,
) -> None:
    """Store a session's tests in `data`: each test file it ran replaces that file's stored tests (a layer can be
    split over two sessions), tests of files gone from the source are dropped; the session's times replace
    those of a stored session of the same name, or of one with the same layers that ended before it began."""
    files = {nodeid.split("::")[0] for durations in ran.values() for nodeid in durations}
    layers = data.setdefault("layers", {})
    for layer, durations in ran.items():
        kept = {
            k: v
            for k, v in layers.get(layer, {}).get("durations", {}).items()
            if k.split("::")[0] not in files and (root / k.split("::")[0]).is_file()
        }
        kept.update(durations)
        layers[layer] = {
            "tests": len(kept),
            "sum_s": round(sum(kept.values()), 1),
            "durations": dict(sorted(kept.items())),
        }
    sessions = data.setdefault("sessions", {})
    for other in list(sessions):
        ended = float(sessions[other].get("ended_epoch", 0))
        if other == key or (set(other.split("+")) & set(ran) and ended <= began):
            del sessions[other]
    sessions[key] = {
        "wall_s": round(wall, 1),
        "began_epoch": round(began, 1),
        "ended_epoch": round(began + wall, 1),
        "workers": workers,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "exit": exitstatus,
    }
    data["about"] = (
        "Per-test seconds (setup + call + teardown) of the last full `make test`, written by "
        "tests/durations_report.py; tests/unit/test_durations_budget.py checks the 60 s budget on it."
    )
    data["goal_s"] = GOAL_S


def sessions_wall(sessions: dict[str, Any]) -> float:
    """The stored sessions' wall time: sessions that ran at the same time count once (the union of their spans)."""
    spans = sorted(
        (float(s["began_epoch"]), float(s["ended_epoch"]))
        for s in sessions.values()
        if "began_epoch" in s and "ended_epoch" in s
    )
    total = sum(float(s.get("wall_s", 0)) for s in sessions.values() if "began_epoch" not in s)
    end = float("-inf")
    for start, stop in spans:
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path` for a read-modify-write (fcntl; without it, unlocked)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _workers(config: pytest.Config) -> int:
    n = getattr(config.option, "numprocesses", None)
    return int(n) if isinstance(n, int) else 0


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def report_lines(
    data: dict[str, Any], ran: dict[str, dict[str, float]], key: str, wall: float, partial: bool, root: Path
) -> list[str]:
    """The summary: the slowest tests of each layer this session ran, each layer's sum, this session's wall
    time, the stored sessions' total against the goal, and the tests over budget without a slow_reason."""
    lines = []
    for layer in sorted(ran):
        durations = ran[layer]
        top = sorted(durations.items(), key=lambda kv: -kv[1])[:TOP]
        lines.append(f"{layer}: {len(durations)} tests, {_minutes(sum(durations.values()))} summed; slowest:")
        lines += [f"  {seconds:7.1f} s  {nodeid}" for nodeid, seconds in top]
    lines.append(f"this session ({key}): {_minutes(wall)} wall" + (" (partial: not stored)" if partial else ""))
    stored = data.get("sessions", {})
    # A stored session that ended before this one began is an earlier run's (`make test`'s other session is
    # still running, or was not run): named, not added to this run's wall time.
    began = float(stored.get(key, {}).get("began_epoch", 0))
    sessions = {k: s for k, s in stored.items() if float(s.get("ended_epoch", began)) >= began}
    earlier = sorted(set(stored) - set(sessions))
    if sessions:
        total = sessions_wall(sessions)
        parts = ", ".join(f"{k} {_minutes(float(s.get('wall_s', 0)))}" for k, s in sorted(sessions.items()))
        verdict = "within" if total <= GOAL_S else "OVER"
        lines.append(
            f"stored sessions: {parts}; {_minutes(total)} of wall time (sessions run side by side counted once), "
            f"{verdict} the {_minutes(GOAL_S)} goal"
            + (f"; not counted, from an earlier run: {', '.join(earlier)}" if earlier else "")
        )
    try:
        late = over_budget({k: v for d in ran.values() for k, v in d.items()}, root)
    except (OSError, SyntaxError, ValueError) as exc:  # a test file this session could not parse either
        late = [f"(not checked: {type(exc).__name__}: {exc})"]
    if late:
        lines.append(f"over the {BUDGET_S:.0f} s budget without @pytest.mark.slow_reason (fails the unit layer):")
        lines += [f"  {t}" for t in late]
    return lines
