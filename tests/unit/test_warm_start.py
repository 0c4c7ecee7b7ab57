"""The launcher's preparation in a forked child: its result and the environment it set come back; its
error comes back as the exit code the CLI documents (the child printed the line)."""

from __future__ import annotations

import os

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
