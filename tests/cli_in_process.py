"""`dtlaunch ARGV` through `cli.run` (the console script's function) inside the test process: the fuzz
harness, the fuzz unit test and the docs test run thousands of commands, and a subprocess each would cost
seconds of imports."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Optional, Sequence


def run_cli(
    argv: list[str], cwd: Optional[Path] = None, extra_path: Sequence[str] = (), stdout: bool = False
) -> tuple[int, str]:
    """(exit code, what the command wrote on stderr, and on stdout too with `stdout`), run from `cwd` with
    `extra_path` ahead of sys.path; argv, cwd and sys.path are restored afterwards."""
    code, err, _ = run_cli_split(argv, cwd, extra_path, merged=stdout)
    return code, err


def run_cli_split(
    argv: list[str], cwd: Optional[Path] = None, extra_path: Sequence[str] = (), merged: bool = False
) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of `dtlaunch argv`, as run_cli; `merged`: stdout goes into stderr's text."""
    from dtlaunch.cli import run

    err = io.StringIO()
    out = err if merged else io.StringIO()
    old_argv, old_cwd, old_path = sys.argv, os.getcwd(), list(sys.path)
    sys.argv = ["dtlaunch", *argv]
    sys.path[:0] = list(extra_path)
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                run()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        if cwd is not None:
            os.chdir(old_cwd)
    return code, err.getvalue(), "" if merged else out.getvalue()
