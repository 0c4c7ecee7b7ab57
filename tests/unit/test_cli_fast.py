"""The CLI as a user starts it: fast help without torch, version, config printing."""

from __future__ import annotations

import subprocess
import sys

import dtlaunch


def dtlaunch_cmd(*args: str, extra_python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *extra_python, "-m", "dtlaunch", *args], capture_output=True, text=True, timeout=120
    )


def test_help_does_not_import_torch() -> None:
    res = dtlaunch_cmd("--help", extra_python=("-X", "importtime"))
    assert res.returncode == 0
    imported = {line.split("|")[-1].strip().split(".")[0] for line in res.stderr.splitlines() if "|" in line}
    assert "typer" in imported
    assert "torch" not in imported
    assert "hydra" not in imported
    assert "train" in res.stdout and "plan" in res.stdout


def test_validate_does_not_import_torch() -> None:
    res = dtlaunch_cmd("validate", "recipe=llama405b_3d", extra_python=("-X", "importtime"))
    assert res.returncode == 0, res.stderr
    assert not any(line.split("|")[-1].strip() == "torch" for line in res.stderr.splitlines())


def test_version() -> None:
    res = dtlaunch_cmd("--version")
    assert res.returncode == 0 and dtlaunch.__version__ in res.stdout


def test_config_prints_yaml_and_resolves() -> None:
    res = dtlaunch_cmd("config", "recipe=demo")
    assert res.returncode == 0
    assert "${stdlib:}" in res.stdout
    res = dtlaunch_cmd("config", "recipe=demo", "--resolve")
    assert res.returncode == 0 and "${stdlib:}" not in res.stdout and "path: /" in res.stdout


def test_console_exit_with_torch_loaded_keeps_code_and_exit_handlers() -> None:
    """console_main skips the interpreter's teardown once torch is loaded (seconds per command), but the exit
    code and the exit handlers are as with an ordinary exit."""
    script = (
        "import atexit, sys, torch\n"
        "atexit.register(lambda: print('exit handler ran', flush=True))\n"
        "sys.argv = ['dtlaunch', 'validate', 'recipe=no_such_recipe']\n"
        "from dtlaunch.cli import console_main\n"
        "console_main()\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "unknown recipe 'no_such_recipe'" in res.stderr
    assert "exit handler ran" in res.stdout


def test_a_live_thread_keeps_the_ordinary_exit() -> None:
    """A non-daemon thread still running: console_main exits the ordinary way, which waits for it; a daemon
    thread does not count. (The test's own process may hold other threads, e.g. pytest-xdist's.)"""
    import threading

    from dtlaunch.run.fast_exit import waited_threads

    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    try:
        assert worker in waited_threads()
    finally:
        release.set()
        worker.join()
    assert worker not in waited_threads()
    hold = threading.Event()
    daemon = threading.Thread(target=hold.wait, daemon=True)  # an exit never waits for a daemon thread
    daemon.start()
    try:
        assert daemon.is_alive() and daemon not in waited_threads()
    finally:
        hold.set()
        daemon.join()
