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
