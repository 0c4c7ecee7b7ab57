"""objective.reference=RUN_DIR (dtlaunch.job.reference_run): what validate refuses before launch, in one
line. The block reads of the run's weights (dtlaunch.convert.run_weights): tests/e2e/test_reference_run_blocks.py;
the losses against the exported reference: tests/e2e/test_dpo_reference_run.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtlaunch.config.schema import to_dict
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate

BASE = ["objective=dpo", "data=synthetic"]


def fake_run(root: Path, model: dict, config: str | None = None) -> Path:
    """A run directory whose newest checkpoint is complete as the catalog checks it (marker, files at their
    sizes); the marker's model section is `model`."""
    step = root / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"m")
    (step / "trainer_state.json").write_text("{}")
    marker = {"files": {".metadata": 1, "trainer_state.json": 2}, "model": model, "step": 2}
    (step / "COMPLETE.json").write_text(json.dumps(marker))
    if config is not None:
        (root / "config.yaml").write_text(config)
    return root


def job(reference: str, *extra: str):
    return compose([*BASE, f"objective.reference={reference}", *extra]).cfg


def refused(reference: str, *extra: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(job(reference, *extra))
    assert "\n" not in str(err.value)
    return str(err.value)


def trained_model() -> dict:
    return to_dict(job("base").model)


def test_a_run_or_its_checkpoint_of_the_same_model_is_accepted(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    model = {**trained_model(), "name": "my-sft", "max_seq_len": 64, "init_from": "hf:/elsewhere"}
    run = fake_run(tmp_path / "run", model, OmegaConf.to_yaml(job("base")))
    validate(job(str(run)))
    validate(job(str(run / "checkpoints" / "step-00000002")))


def test_missing_dir_no_checkpoint_and_corrupt_config_are_refused(tmp_path: Path) -> None:
    msg = refused(str(tmp_path / "nope"))
    assert msg.startswith(f"objective.reference='{tmp_path / 'nope'}': no such directory"), msg
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint" in refused(str(tmp_path / "empty"))
    run = fake_run(tmp_path / "run", trained_model(), "training: [unclosed\n")
    msg = refused(str(run))
    assert "config.yaml" in msg and "restore the run's config.yaml" in msg, msg


def test_another_architecture_is_refused_naming_the_key(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", {**trained_model(), "n_layers": 2})
    msg = refused(str(run), "model.n_layers=4")
    assert "model.n_layers=2" in msg and "model.n_layers=4" in msg and "give a reference run" in msg, msg


def test_a_spoiled_marker_is_refused(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", {"arch": "llama", "dim": "wide"})
    assert "not a model" in refused(str(run))


def test_precomputed_reference_key_follows_the_runs_newest_checkpoint(tmp_path: Path) -> None:
    """objective.precompute_reference's file is not reused once the reference run has saved a newer
    checkpoint (its log-probs would be another model's)."""
    from dtlaunch.train.objectives.precompute import reference_key

    run = fake_run(tmp_path / "run", trained_model())
    before = reference_key(job(str(run)))
    assert reference_key(job(str(run))) == before
    newer = fake_run(tmp_path / "newer", trained_model()) / "checkpoints" / "step-00000002"
    newer.rename(run / "checkpoints" / "step-00000004")
    assert reference_key(job(str(run))) != before
