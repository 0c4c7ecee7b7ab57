"""Runs one hostile case through the real console entry point in-process and lists what went wrong.

The invariants every case must keep, whatever it is handed:
- exit 0, 2 (bad input) or 3 (the memory plan does not fit), nothing else;
- a refusal is exactly one line on stderr, `dtlaunch: error: ...`; no traceback, no internal error;
- nothing executed: a `$(touch PWNED)` anywhere in a value creates no file named PWNED;
- nothing the user owns changed: every input file hashes the same before and after;
- nothing created outside the output directory the case was given.

Profiles (DTLAUNCH_FUZZ_PROFILE): `ci` (default, about a minute in all) and `night` (thousands of cases).
DTLAUNCH_FUZZ_KEEP_GOING=1 records every wrong ending instead of stopping at the first (a night run
reports them all), DTLAUNCH_FUZZ_REPORT=FILE appends one JSON line per kind: cases, exit codes, failures.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cli_in_process import run_cli
from hypothesis import HealthCheck, Phase, settings

MARKER = "PWNED"
# Shell and Hydra metacharacters, newlines and command substitutions: each must stay inert text.
HOSTILE_TEXT = [
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"; touch {MARKER}",
    f"| touch {MARKER}",
    f"&& touch {MARKER}",
    f"a\ntouch {MARKER}",
    "\r\n",
    "a b c",
    "'quoted'",
    '"dq"',
    "${oc.env:HOME}",
    "${stdlib:}",
    "${nope}",
    "{{ 7*7 }}",
    "%s%n",
    "..",
    "../../escape",
    "/etc/passwd",
    "\x00",
    "é😀",
    "~",
    "*",
    "[",
    "",
    " ",
    "x" * 300,
]

PROFILES = {
    # CI: every kind a few dozen cases, shrinking on (a failure is reported minimal).
    "ci": {"night": False, "phases": (Phase.explicit, Phase.generate, Phase.shrink)},
    # Night: each kind's night count (over 5,000 in all), no shrinking (with DTLAUNCH_FUZZ_KEEP_GOING=1
    # every wrong ending is logged).
    "night": {"night": True, "phases": (Phase.explicit, Phase.generate)},
}


def profile() -> dict:
    name = os.environ.get("DTLAUNCH_FUZZ_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"DTLAUNCH_FUZZ_PROFILE={name}: use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def fuzz_settings(ci_examples: int, night_examples: int) -> settings:
    """Seeded (derandomize): the same cases every run, so a CI failure reproduces locally."""
    p = profile()
    return settings(
        max_examples=night_examples if p["night"] else ci_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=p["phases"],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root: a file's content hash, 'dir' for a directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.join(dirpath, d)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            try:
                with open(p, "rb") as fh:
                    out[p] = hashlib.sha256(fh.read()).hexdigest()
            except OSError as exc:
                out[p] = f"unreadable {exc.errno}"
    return out


@dataclass
class Case:
    """One hostile invocation: argv, the directories holding the user's inputs (must not change) and
    the directory it may write to."""

    argv: list[str]
    inputs: list[Path]
    outputs: Path
    note: str = ""


@dataclass
class Tally:
    kind: str
    cases: int = 0
    codes: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def report(self, progress: bool = False) -> None:
        line = {
            "progress": progress,
            "kind": self.kind,
            "cases": self.cases,
            "codes": {str(k): v for k, v in sorted(self.codes.items())},
            "failures": len(self.failures),
            "seconds": round(time.monotonic() - self.started, 1),
            "profile": os.environ.get("DTLAUNCH_FUZZ_PROFILE", "ci"),
        }
        print(f"fuzz {json.dumps(line)}")
        path = os.environ.get("DTLAUNCH_FUZZ_REPORT")
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps({**line, "examples": self.failures[:50]}) + "\n")


def check(case: Case, scratch: Path, tally: Tally) -> None:
    """Run the case; record its exit code; raise AssertionError on a broken invariant (or log it and go
    on, with DTLAUNCH_FUZZ_KEEP_GOING=1)."""
    before = {str(d): tree(d) for d in case.inputs}
    around = set(tree(scratch))
    code, err = run_cli(case.argv)
    tally.cases += 1
    tally.codes[code] = tally.codes.get(code, 0) + 1
    if tally.cases % 100 == 0:
        tally.report(progress=True)  # a long run's count so far, should it be stopped
    problems = wrong_endings(code, err)
    for d in case.inputs:
        if tree(d) != before[str(d)]:
            changed = sorted(set(tree(d).items()) ^ set(before[str(d)].items()))
            problems.append(f"changed the user's {changed[0][0]}")
    created = [p for p in set(tree(scratch)) - around if not p.startswith(str(case.outputs))]
    if created:
        problems.append(f"created {sorted(created)[0]} outside {case.outputs}")
    if any(Path(p).name == MARKER for p in tree(scratch)) or (Path.cwd() / MARKER).exists():
        problems.append("ran an injected command")
    if problems:
        msg = f"{case.note} {case.argv}: {problems}: {err.strip()[-400:]}"
        tally.failures.append(msg)
        if os.environ.get("DTLAUNCH_FUZZ_KEEP_GOING") != "1":
            raise AssertionError(msg)


def wrong_endings(code: int, err: str) -> list[str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    problems = []
    if code not in (0, 2, 3):
        problems.append(f"exit {code}")
    if "Traceback" in err or "internal error" in err:
        problems.append("traceback or internal error")
    if code != 0 and (len(lines) != 1 or not lines[0].startswith("dtlaunch: error: ")):
        problems.append(f"{len(lines)} lines on stderr, not one `dtlaunch: error:` line")
    if code == 0 and any("error" in ln.lower() for ln in lines):
        problems.append("exit 0 with an error on stderr")
    return problems


def fuzz(kind: str, body: Callable[..., Any]) -> Tally:
    """A Tally for `kind`, reported (stdout, DTLAUNCH_FUZZ_REPORT) after `body(tally)` ran."""
    tally = Tally(kind)
    try:
        body(tally)
    finally:
        tally.report()
    assert not tally.failures, f"{len(tally.failures)} of {tally.cases} {kind} cases failed:\n" + "\n".join(
        tally.failures[:20]
    )
    return tally
