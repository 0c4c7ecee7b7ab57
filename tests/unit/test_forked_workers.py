"""A worker forked from the launcher (dtlaunch.launch.forked_workers) starts as `python -u -m
dtlaunch.train.main` would: exactly the agent's environment, a session of its own, a fresh interpreter's
signal dispositions, none of the launcher's exit handlers, torch's thread count from OMP_NUM_THREADS, and
its exit status as the interpreter would give it. The worker's main is replaced here by one that writes
what it sees (the whole training path runs forked in every multi-process test)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import types
from pathlib import Path

import pytest

from dtlaunch.launch import forked_workers
from dtlaunch.run.env import WORKER_MODULE


@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A stand-in for dtlaunch.train.main whose main() reports into a file, then acts as told."""
    import torch  # noqa: F401 (imported here as in a launcher: the fork finds it)

    out = tmp_path / "seen.json"
    module = types.ModuleType(WORKER_MODULE)
    module.__file__ = "/fake/dtlaunch/train/main.py"

    def main() -> None:
        seen = {
            "env": dict(os.environ),
            "sid_is_pid": os.getsid(0) == os.getpid(),
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigusr1": str(signal.getsignal(signal.SIGUSR1)),
            "threads": torch.get_num_threads(),
            "argv": sys.argv,
            "stdout_unbuffered": sys.stdout.write_through,
        }
        out.write_text(json.dumps(seen))
        action = os.environ["ACT"]
        if action == "raise":
            raise RuntimeError("worker failed")
        if action == "exit3":
            sys.exit(3)
        if action == "os_exit0":
            os._exit(0)

    def exit_failed() -> None:
        os._exit(1)

    module.main = main
    module.exit_failed = exit_failed
    monkeypatch.setitem(sys.modules, WORKER_MODULE, module)
    return out


def _start(env: dict[str, str], launchers_exit_mark: Path) -> forked_workers.ForkedWorker:
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # a launcher's handler, not to be inherited
    atexit.register(launchers_exit_mark.touch)  # a launcher's exit handler, not the worker's to run
    try:
        return forked_workers.ForkedWorker(env, restore_log_levels={})
    finally:
        signal.signal(signal.SIGUSR1, previous)
        atexit.unregister(launchers_exit_mark.touch)


@pytest.mark.parametrize(("act", "status"), [("return", 0), ("os_exit0", 0), ("exit3", 3), ("raise", 1)])
def test_a_forked_worker_starts_as_a_fresh_python_would(fake_worker: Path, act: str, status: int) -> None:
    env = {"ACT": act, "OMP_NUM_THREADS": "1", "RANK": "1", "PATH": os.environ.get("PATH", "")}
    mark = fake_worker.with_name("launcher-exit")
    worker = _start(env, mark)
    assert worker.wait(timeout=60) == status
    assert not mark.exists()
    seen = json.loads(fake_worker.read_text())
    assert seen["env"] == env  # nothing of the launcher's environment but what the agent passed
    assert seen["sid_is_pid"]
    assert seen["sigterm"] == str(signal.SIG_DFL) and seen["sigusr1"] == str(signal.SIG_DFL)
    assert seen["sigint"]
    assert seen["threads"] == 1
    assert seen["argv"] == ["/fake/dtlaunch/train/main.py"]
    assert seen["stdout_unbuffered"]


@pytest.mark.parametrize("asked", ["same", "3"])
def test_a_forked_worker_runs_the_thread_count_it_was_given(fake_worker: Path, asked: str) -> None:
    """OMP_NUM_THREADS as a fresh worker reads it, whether or not it equals the launcher's own count (the
    fork leaves an equal count as it is: see `_run_worker`)."""
    import torch

    threads = str(torch.get_num_threads()) if asked == "same" else asked
    env = {"ACT": "return", "OMP_NUM_THREADS": threads}
    worker = _start(env, fake_worker.with_name("launcher-exit"))
    assert worker.wait(timeout=60) == 0
    assert json.loads(fake_worker.read_text())["threads"] == int(threads)


def test_poll_and_signals_reach_the_forked_worker(fake_worker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules[WORKER_MODULE]
    monkeypatch.setattr(module, "main", lambda: signal.pause())
    worker = _start({"ACT": "return"}, fake_worker.with_name("launcher-exit"))
    assert worker.poll() is None
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == -signal.SIGTERM
    assert worker.poll() == -signal.SIGTERM


def test_only_a_launcher_that_preloaded_having_computed_nothing_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has run CPU kernels (other tests): its forks could deadlock in OpenMP, so it is not
    `ready` until a launcher's warm start preloads; `launch.worker_start=exec` always execs."""
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.local import use_forks

    cfg = compose(["recipe=tiny_ddp"]).cfg
    assert not forked_workers.ready() and not use_forks(cfg)
    monkeypatch.setattr(forked_workers, "_preloaded", True)  # as warm_start.prepare_aside leaves it
    assert use_forks(cfg)
    cfg.launch.worker_start = "exec"
    assert not use_forks(cfg)
