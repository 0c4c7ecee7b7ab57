"""A process that asked to die with its parent dies when the parent does, however the parent ended, and
at once when the parent is gone before the request was in place."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# The parent starts a child that asks to die with it (`expected` its parent's pid, or a wrong one), prints
# the child's pid once the request is in place, then dies by SIGKILL: no cleanup of its own runs.
PARENT = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
from dtlaunch.run.parent_death import die_with_parent
die_with_parent(os.getppid() + int(sys.argv[1]))
print("armed", flush=True)
time.sleep(60)
''', sys.argv[1]], stdout=subprocess.PIPE, text=True, start_new_session=True)
if child.stdout.readline().strip() == "armed":
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie waits for a reaper that may not exist in a container: it is dead


def run_parent(offset: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run(
        [sys.executable, "-c", PARENT, str(offset)], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_child_dies_with_its_sigkilled_parent() -> None:
    parent = run_parent(0)
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 2
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = not alive(pid)
    if not gone:
        os.kill(pid, 9)
    assert gone, "the child outlived its parent by 2 s"


def test_a_parent_gone_before_the_request_kills_at_once() -> None:
    """The pid given is not the parent's now: the parent it named died before prctl ran."""
    parent = run_parent(1)
    assert parent.stdout == "", parent.stdout  # the child died in die_with_parent, before "armed"
