"""A process that must not outlive its parent asks the kernel to kill it when the parent dies.

torchrun starts every worker in a session of its own, so a launcher killed by SIGKILL (the OOM killer,
`kill -9`, a terminal's process group) takes none of them along: they would go on training, saving and
pruning checkpoints that a restarted launcher is reading. prctl(PR_SET_PDEATHSIG) makes the kernel send
a signal when the parent goes, whatever killed it. Linux only; elsewhere nothing changes.
"""

from __future__ import annotations

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Have `sig` sent to this process when `parent` (its parent now) dies; if the parent is gone
    already (it died before the request was in place), send it now. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The kernel signals on the death of the parent that exists when prctl runs: one that died before
    # was replaced by init or a subreaper, which the request then watches instead.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_launcher() -> bool:
    """In a worker: die with its parent, the agent that started it. That is the `dtlaunch train`
    process that set AGENT_PID_ENV when there is one (a parent gone before this runs is told apart
    from it by pid); under a plain torchrun, the parent this process has now."""
    from dtlaunch.run.preemption import AGENT_PID_ENV

    agent = os.environ.get(AGENT_PID_ENV, "")
    return die_with_parent(int(agent) if agent.isdigit() else os.getppid())
