"""dtlaunch composes a job with Hydra 1.3's own steps minus Hydra's `hydra` node (dtlaunch.job.compose:
`_compose_without_hydra_node`, half of compose's time). Held here to what `hydra.compose` itself gives, on
every shipped recipe and on overrides that exercise the grammar: the same job, node for node and in the same
order, the same group choices, and the same exception for a bad override."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

import dtlaunch.job.compose as compose_mod
from dtlaunch.job.model_schema import register_schemas

OVERRIDE_SETS = [
    ["model=tiny", "strategy=fsdp", "training.micro_batch=2", "peft=lora", "peft.targets=[wq,wv]"],
    ["objective=grpo", "optim.lr=3e-4", "training.eval_tasks=[arc_easy]"],
    ["model=llama3_8b", "precision=bf16", "hardware=h100_80gb", "data=tokens", "data.path=/x"],
]
BAD = [
    ["training.micro_btach=2"],  # a key the job lacks (struct mode)
    ["model=no_such_model"],  # a missing group option
    ["training.micro_batch=[1"],  # the override grammar
]


def _both(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    compose_mod._register_resolvers()
    register_schemas()
    rest, recipe_file, recipe_name = compose_mod._split_recipe(list(overrides), compose_mod.list_recipes(()))
    if recipe_file is not None:
        rest.append(f"recipe={recipe_name}")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        compose_mod._build_search_dir(Path(tmp), recipe_file, recipe_name)
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=tmp, version_base="1.3", job_name="dtlaunch"):
                for run in (
                    lambda: hydra_compose(config_name="job", overrides=rest, return_hydra_config=True),
                    lambda: compose_mod._compose_without_hydra_node(rest),
                ):
                    try:
                        out.append(run())
                    except Exception as exc:  # noqa: BLE001 - compared, not handled
                        out.append(exc)
        finally:
            GlobalHydra.instance().clear()
    return out


@pytest.mark.parametrize(
    "overrides",
    [[f"recipe={p.stem}"] for p in sorted(compose_mod.BUILTIN_RECIPES_DIR.glob("*.yaml"))] + OVERRIDE_SETS,
    ids=lambda o: " ".join(o),
)
def test_same_job_and_choices_as_hydra_compose(overrides):
    full, lean = _both(overrides)
    assert not isinstance(full, Exception), full
    cfg, choices = lean
    full_choices = {k: v for k, v in full.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with open_dict(full):
        del full["hydra"]
    assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(full)
    assert OmegaConf.get_type(cfg) is OmegaConf.get_type(full)
    assert OmegaConf.is_struct(cfg) and OmegaConf.is_struct(full)
    assert {k: v for k, v in choices.items() if not k.startswith("hydra")} == full_choices
    assert full_choices["model"]  # the groups really were chosen


@pytest.mark.parametrize("overrides", BAD, ids=lambda o: " ".join(o))
def test_same_error_as_hydra_compose(overrides):
    full, lean = _both(overrides)
    assert isinstance(full, Exception) and isinstance(lean, Exception), (full, lean)
    assert type(lean) is type(full) and str(lean) == str(full)
