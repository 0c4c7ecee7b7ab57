"""Errors the user caused, each carrying the exit code the CLI documents."""

from __future__ import annotations

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
