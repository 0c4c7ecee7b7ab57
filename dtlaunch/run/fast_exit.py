"""Ending a process that has torch loaded without the interpreter's teardown: unloading torch's modules
takes 0.5-2 s, which every `dtlaunch` command that imported torch, and every worker that torchrun waits for
before it restarts or stops a job, paid for nothing. The launcher's console script and the worker share it."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def waited_threads() -> list[threading.Thread]:
    """The non-daemon threads besides this one that are alive: the ordinary exit would wait for them."""
    current = threading.current_thread()
    return [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]


def other_threads_alive() -> bool:
    """Whether the ordinary exit would wait for a thread, so that the caller must take that exit instead."""
    return bool(waited_threads())


def exit_now(code: int) -> NoReturn:
    """Run the exit handlers (logging, temporary directories, trackers), flush the standard streams and end
    the process with `code`, skipping the module teardown."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more reaches it either way
            pass
    os._exit(code)
