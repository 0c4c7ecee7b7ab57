"""Composition: every recipe composes, precedence is schema < group < recipe < command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import RECIPE_PATH_ENV, compose, list_recipes, load_resolved

ALL_RECIPES = sorted(list_recipes())
REQUIRED = {
    "llama8b_fsdp",
    "llama8b_ddp",
    "llama70b_fsdp_tp",
    "llama405b_3d",
    "llama2_7b_zero2",
    "tiny_ddp",
    "tiny_fsdp",
    "tiny_tp",
    "tiny_pp",
    "tiny_3d",
    "demo",
}


def test_required_recipes_ship() -> None:
    assert REQUIRED <= set(ALL_RECIPES)


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_every_recipe_composes_and_validates(name: str) -> None:
    job = load_job([f"recipe={name}"])
    assert job.cfg.recipe == name
    assert job.layout.world == job.layout.dp * job.layout.cp * job.layout.tp * job.layout.pp


def write_recipe(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text("# @package _global_\n" + body)
    return path


RECIPE_BODY = """defaults:
  - override /model: tiny
model:
  dim: 96
training:
  seq_len: 48
"""


def test_precedence_schema_group_recipe_cli(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "mine", RECIPE_BODY)
    cfg = compose([f"recipe={recipe}"]).cfg
    assert cfg.training.log_every == 1  # schema default: no group or recipe sets it
    assert cfg.model.n_layers == 4  # from the model group (schema default is also 4: check a group-only value)
    assert cfg.model.vocab_size == 512  # group (tiny) beats schema (256)
    assert cfg.model.dim == 96  # recipe beats group (64)
    cfg = compose([f"recipe={recipe}", "model.dim=32"]).cfg
    assert cfg.model.dim == 32  # command line beats recipe
    # Selecting another group option on the command line replaces the recipe's choice of group,
    # while the recipe's own values still apply on top of it.
    cfg = compose([f"recipe={recipe}", "model=small"]).cfg
    assert cfg.model.name == "small" and cfg.model.dim == 96


def test_recipe_by_path_flag_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flag_dir, env_dir = tmp_path / "flag", tmp_path / "env"
    write_recipe(flag_dir, "from_flag", RECIPE_BODY)
    write_recipe(env_dir, "from_env", RECIPE_BODY)
    assert compose(["recipe=from_flag"], [str(flag_dir)]).cfg.model.dim == 96
    monkeypatch.setenv(RECIPE_PATH_ENV, str(env_dir))
    assert compose(["recipe=from_env"]).cfg.recipe == "from_env"
    assert "from_env" in list_recipes()


def test_user_recipe_shadows_builtin(tmp_path: Path) -> None:
    write_recipe(tmp_path, "tiny_ddp", RECIPE_BODY)
    assert compose(["recipe=tiny_ddp"], [str(tmp_path)]).cfg.model.dim == 96
    assert compose(["recipe=tiny_ddp"]).cfg.model.dim == 64


def test_override_grammar_list_append_delete() -> None:
    cfg = compose(["recipe=tiny_pp", "model=tiny_deep", "strategy.pp_layers_per_stage=[3,5]"]).cfg
    assert list(cfg.strategy.pp_layers_per_stage) == [3, 5]
    # `~key` resets a field to its schema default (the schema is the only home of defaults).
    cfg = compose(["model=llama3_8b", "~model.rope_scaling"]).cfg
    assert cfg.model.rope_scaling is None
    with pytest.raises(ConfigError, match="training.nope"):
        compose(["+training.nope=1"])


def test_stdlib_resolver_resolved_once() -> None:
    composed = compose(["data=python_stdlib"])
    assert "${stdlib:}" in composed.unresolved_yaml
    assert Path(composed.cfg.data.path, "os.py").is_file()


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = compose(["recipe=llama405b_3d"]).cfg
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    again = load_resolved(tmp_path / "config.yaml")
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    (tmp_path / "bad.yaml").write_text("training:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_resolved(tmp_path / "bad.yaml")


def test_optional_section_set_from_command_line() -> None:
    # Llama-2 has no RoPE scaling (null): setting the whole section or one field of it must work.
    cfg = compose(["model=llama2_7b", "model.rope_scaling={factor:4.0}"]).cfg
    assert cfg.model.rope_scaling.factor == 4.0 and cfg.model.rope_scaling.high_freq_factor == 4.0
    assert compose(["model.rope_scaling.low_freq_factor=2.0"]).cfg.model.rope_scaling.low_freq_factor == 2.0
    assert compose(["model=llama3_8b", "model.rope_scaling=null"]).cfg.model.rope_scaling is None
    with pytest.raises(ConfigError, match="did you mean 'factor'"):
        compose(["model.rope_scaling.fctor=2"])
