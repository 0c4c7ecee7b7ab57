"""Errors the user caused, each carrying the exit code the CLI documents."""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_PLAN_DOES_NOT_FIT = 3
# A preempted run (SIGTERM/SIGUSR1) that saved its checkpoint; a new start resumes it.
EXIT_PREEMPTED = 75
EXIT_WORKER_FAILED = 1


class DtlaunchError(Exception):
    """An expected failure with a one-line message; the CLI prints it without a traceback."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(DtlaunchError):
    """Bad configuration or arguments: exit 2."""


class InputError(DtlaunchError):
    """A missing or unreadable file, a bad run directory: exit 2."""


class PlanDoesNotFit(DtlaunchError):
    exit_code = EXIT_PLAN_DOES_NOT_FIT


class WorkerFailed(DtlaunchError):
    exit_code = EXIT_WORKER_FAILED


class Preempted(DtlaunchError):
    exit_code = EXIT_PREEMPTED


# What to do about an OS error on a path the user gave (a recipe, --out, run.dir, data.path, a checkpoint).
_OS_ERROR_FIXES = {
    "ENAMETOOLONG": "the path is longer than the file system allows: use a shorter path",
    "EACCES": "permission denied: choose a location you can read and write, or fix its permissions",
    "EPERM": "operation not permitted: choose another location or fix its permissions",
    "EISDIR": "it is a directory where a file is needed: give a file path",
    "ENOTDIR": "a part of the path is a file where a directory is needed: give a directory path",
    "EEXIST": "it already exists as a file where a directory is needed: give a directory path",
    "ENOENT": "it does not exist: check the path",
    "ENOSPC": "no space left on the device: free space or choose another location",
    "EROFS": "the file system is read-only: choose a writable location",
    "ELOOP": "too many symbolic links: fix the link",
    "ENOTEMPTY": "the directory is not empty: choose an empty or new directory",
}


def os_error_message(exc: OSError) -> str:
    """One line for an OS error on a user-given path: the path, the system's reason and the fix."""
    import errno

    name = errno.errorcode.get(exc.errno or -1, "")
    path = exc.filename if exc.filename2 is None else f"{exc.filename}' -> '{exc.filename2}"
    reason = exc.strerror or type(exc).__name__
    fix = _OS_ERROR_FIXES.get(name, "check the path and its permissions")
    shown = str(path) if len(str(path)) <= 160 else str(path)[:100] + "..." + str(path)[-40:]
    return f"cannot use '{shown}': {reason}; {fix}"


def exit_code_of(exc: BaseException, debug: bool = False) -> int:
    """Print the one line the user sees for `exc` (on stderr) and return the documented exit code. With
    `debug` (the CLI's --debug), the traceback comes first; the exit code stays the documented one (scripts
    branch on it)."""
    # The CLI framework's own exceptions; imported here so that workers, which import this module for its
    # error classes, never load it.
    import typer

    if isinstance(exc, SystemExit):
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        return int(exc.code or 0)
    if isinstance(exc, typer.Exit):
        return int(exc.exit_code)
    if isinstance(exc, DtlaunchError):
        _traceback_if(debug, exc)
        # One line whatever a message echoes (a file name or value can hold a newline): shown escaped.
        print(f"dtlaunch: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, OSError):
        # An OS error on a named path is bad input (a path too long, not writable, a file where a
        # directory belongs): mapped here once for every command instead of at each file operation.
        if exc.filename is None:
            return _internal_error(exc, debug)
        _traceback_if(debug, exc)
        print(f"dtlaunch: error: {os_error_message(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(exc, (typer.Abort, KeyboardInterrupt)):
        print("dtlaunch: interrupted", file=sys.stderr)
        return 130
    if isinstance(exc, Exception) and hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
        # A (typer-vendored) click usage error: one line like every other refusal (click's own display
        # is three), with where the usage is.
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        print(f"dtlaunch: error: {exc.format_message()}{hint}", file=sys.stderr)
        return int(exc.exit_code)
    return _internal_error(exc, debug)


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _traceback_if(debug: bool, exc: BaseException) -> None:
    if debug:
        import traceback

        traceback.print_exception(exc)


def _internal_error(exc: BaseException, debug: bool) -> int:
    _traceback_if(debug, exc)
    if debug:
        return 1
    print(
        f"dtlaunch: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", file=sys.stderr
    )
    return 1
