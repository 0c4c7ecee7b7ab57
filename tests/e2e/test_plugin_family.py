"""A model family added from outside dtlaunch (tests/plugins/toyfam: its module, its TP plan as data, its
registry entry, its own model field `mlp_ratio`) trains through the real CLI with tensor parallel, at loss
parity with one process, and is planned by tracing; dtlaunch's own files are not touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
TOY = ["model.arch=toy", "model.family_module=toyfam", "model.dim=64", "model.n_layers=2", "model.vocab_size=256"]
TOY += ["model.mlp_ratio=2"]


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH", "")])))


@pytest.mark.slow
def test_toy_family_trains_with_tensor_parallel_at_parity(trainer, tmp_path, plugin_path):
    one = trainer.run(tmp_path / "one", "recipe=tiny_tp", *TOY, "launch.nproc_per_node=1", "strategy.tp=1")
    tp = trainer.run(tmp_path / "tp", "recipe=tiny_tp", *TOY, "launch.nproc_per_node=2", "strategy.tp=2")
    assert one.returncode == 0 and tp.returncode == 0
    ref, got = trainer.losses(tmp_path / "one"), trainer.losses(tmp_path / "tp")
    assert len(ref) == len(got) == 5
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-4, (ref, got)


def test_toy_family_is_planned_and_bad_module_is_one_line(trainer, plugin_path):
    plan = trainer.cli(["plan", "recipe=tiny_tp", *TOY])
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "tracing one training step" in plan.stdout.replace("\n", " ")
    bad = trainer.cli(["plan", "recipe=tiny_tp", *TOY[:1], "model.family_module=no_such_family"])
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.family_module='no_such_family'" in lines[0], bad.stderr


def test_toy_family_field_is_its_own(trainer, plugin_path):
    """The plug-in's field is typed by its schema, and refused on a family without it."""
    wrong_type = trainer.cli(["validate", "recipe=tiny_tp", *TOY[:-1], "model.mlp_ratio=wide"])
    assert wrong_type.returncode == 2 and "model.mlp_ratio" in wrong_type.stderr, wrong_type.stderr
    other = trainer.cli(["validate", "recipe=tiny_tp", "model.family_module=toyfam", "model.mlp_ratio=2"])
    lines = [line for line in other.stderr.splitlines() if line.strip()]
    assert other.returncode == 2 and len(lines) == 1, other.stderr
    assert "model.mlp_ratio=2 with model.arch=llama" in lines[0] and "model.arch=toy" in lines[0], lines[0]
