"""A model section is typed by its family's own schema: the fields every family shares (ModelConfig) plus
the family's (models/dense/config.py, models/moe/config.py); other families' fields are refused unless
they hold their defaults, and before the family is known the union of all of them checks keys and types."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from dtlaunch.config.schema import ModelConfig
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose, load_resolved
from dtlaunch.job.model_schema import _union, job_schema, typed_job
from dtlaunch.models.dense.config import DenseModelConfig
from dtlaunch.models.moe.config import MoeModelConfig


def test_a_dense_job_has_the_dense_fields_only() -> None:
    m = compose(["model=tiny"]).cfg.model
    assert OmegaConf.get_type(m) is DenseModelConfig
    assert "qk_norm" in m and "moe" not in m
    moe = compose(["model=tiny_moe"]).cfg.model
    assert OmegaConf.get_type(moe) is MoeModelConfig and moe.moe.num_experts == 8 and "qk_norm" in moe


def test_another_familys_field_is_one_line_naming_it_and_where_it_lives() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["model=tiny", "model.moe.num_experts=4"])
    text = str(err.value)
    assert "model.moe.num_experts=4 with model.arch=llama" in text
    assert "mixtral" in text and "qwen3_moe" in text and "\n" not in text


def test_another_familys_field_at_its_default_means_nothing() -> None:
    """Config files written before the schema split carry every family's fields at their defaults."""
    flat = OmegaConf.to_container(OmegaConf.structured(job_schema()))
    flat["model"]["arch"] = "llama"  # type: ignore[index]
    typed = typed_job(flat)
    assert "moe" not in typed.model and typed.model.qk_norm is False


def test_old_run_config_with_flat_model_section_loads(tmp_path) -> None:
    job = OmegaConf.to_container(compose(["model=tiny"]).cfg)
    job["model"]["moe"] = {"num_experts": 0, "top_k": 2, "score_func": "softmax"}  # type: ignore[index]
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(job))
    cfg = load_resolved(path)
    assert "moe" not in cfg.model and cfg.model.dim == 64


def test_keys_and_types_are_checked_before_the_family_is_known() -> None:
    with pytest.raises(ConfigError, match=r"model.qk_norm.*true or false"):
        compose(["model=tiny", "model.qk_norm=sometimes"])
    with pytest.raises(ConfigError, match=r"unknown key 'model.qk_nrom' \(did you mean 'qk_norm'\?\)"):
        compose(["model=tiny", "model.qk_nrom=true"])
    with pytest.raises(ConfigError, match=r"model.moe.top_k"):
        compose(["model=tiny_moe", "model.moe.top_k=two"])


def test_reset_to_default_reaches_family_fields() -> None:
    m = compose(["model=qwen3_0.6b", "~model.qk_norm"]).cfg.model
    assert m.qk_norm is False


def test_two_families_cannot_type_one_field_two_ways() -> None:
    @dataclasses.dataclass
    class A(ModelConfig):
        width: int = 1

    @dataclasses.dataclass
    class B(ModelConfig):
        width: str = "x"

    with pytest.raises(ConfigError, match=r"model.width is typed"):
        _union((A, B))
    assert {f.name for f in dataclasses.fields(_union((A, DenseModelConfig)))} >= {"width", "qk_norm", "dim"}
