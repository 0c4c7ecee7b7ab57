"""The launcher's preparation in a forked child: its result and the environment it set come back; its
error comes back as the exit code the CLI documents (the child printed the line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dtlaunch.errors import ConfigError
from dtlaunch.launch.warm_start import Prepared, prepare_aside


def _report(exc: BaseException) -> int:
    return exc.exit_code if isinstance(exc, ConfigError) else 1


def test_the_child_hands_over_what_it_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DTLAUNCH_TEST_HANDOVER", raising=False)
    monkeypatch.setenv("DTLAUNCH_TEST_REMOVED", "1")

    def prepare() -> Prepared:
        os.environ["DTLAUNCH_TEST_HANDOVER"] = "set by the child"
        del os.environ["DTLAUNCH_TEST_REMOVED"]
        return Prepared(run_dir="/runs/x", layout=(2, 1), recipe="tiny_ddp", cfg=OmegaConf.create({"a": {"b": 1}}))

    prepared, code = prepare_aside(prepare, _report)
    assert code == 0 and prepared is not None
    assert (prepared.run_dir, prepared.layout, prepared.recipe) == ("/runs/x", (2, 1), "tiny_ddp")
    assert prepared.cfg == {"a": {"b": 1}}  # the config as its plain container
    assert os.environ["DTLAUNCH_TEST_HANDOVER"] == "set by the child"
    assert "DTLAUNCH_TEST_REMOVED" not in os.environ


def test_the_childs_error_is_its_exit_code() -> None:
    def prepare() -> Prepared:
        raise ConfigError("unknown key 'model.dimm'")

    assert prepare_aside(prepare, _report) == (None, 2)


def test_a_crash_in_the_child_is_not_success() -> None:
    def prepare() -> Prepared:
        os._exit(0)  # gone without a handover

    assert prepare_aside(prepare, _report) == (None, 1)


# Runs `dtlaunch train` with a hook on the import of torch's agent that waits, inside an object's
# `__del__` (where Python only prints an exception: "Exception ignored in ..."), until the child has
# failed: the child's exit lands inside the import every time, not in 1 run of 20.
_EXIT_DURING_IMPORT = """
import importlib.abc, os, sys, time

parent = os.getpid()

class Waits:
    def __del__(self):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("the child's failure never ended the launcher", file=sys.stderr)

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and os.getpid() == parent:  # the first module the import of the agent loads
            sys.meta_path.remove(self)
            Waits()  # dropped at once: its __del__ runs here, inside the import
        return None

sys.meta_path.insert(0, Hook())
sys.argv[0] = "dtlaunch"
from dtlaunch.cli import run
run()
"""


@pytest.mark.slow
def test_a_child_failing_during_the_import_gives_one_line_and_its_code(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    if not overlap_possible_here():
        pytest.skip("no second core: the preparation is not forked")
    cmd = [sys.executable, "-c", _EXIT_DURING_IMPORT, "train", "recipe=tiny_ddp", "data=tokens"]
    cmd += ["data.path=/no/such/dir", f"run.dir={tmp_path / 'run'}"]
    began = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("dtlaunch: error: data.path="), proc.stderr[-3000:]
    assert took < 15, took  # ended by the child's failure, not by the hook's 20 s wait


def overlap_possible_here() -> bool:
    return (os.cpu_count() or 1) >= 2 and hasattr(os, "fork")
