"""torchao's and torch's import-time log lines that mean nothing for a job are silenced, one by one; the rest of
what those loggers say still shows."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from dtlaunch.run.known_noise import KNOWN_NOISE, silence_known_noise


def test_importing_torchao_and_transformers_prints_none_of_the_known_lines() -> None:
    pytest.importorskip("torchao")
    code = (
        "from dtlaunch.run.known_noise import silence_known_noise\n"
        "silence_known_noise()\n"
        "import torchao, torchao.kernel.intmm, transformers.modeling_utils\n"
        "import logging; logging.getLogger('torchao').warning('any other torchao line')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not [frag for _, frag in KNOWN_NOISE if frag in res.stderr], res.stderr
    assert "any other torchao line" in res.stderr


def test_only_the_known_messages_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    silence_known_noise()
    silence_known_noise()  # once per process, however often called
    for name, fragment in KNOWN_NOISE:
        logger = logging.getLogger(name)
        assert sum(getattr(f, "fragment", None) == fragment for f in logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=name):
            caplog.clear()
            logger.warning("x %s y", fragment)
            logger.warning("something else")
        assert [r.getMessage() for r in caplog.records if r.name == name] == ["something else"]
