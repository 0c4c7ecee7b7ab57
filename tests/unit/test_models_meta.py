"""Every shipped model, built on the meta device, has exactly the closed-form parameter count."""

from __future__ import annotations

import pytest

from dtlaunch.job.compose import compose, group_options
from dtlaunch.models.registry import model_spec
from dtlaunch.models.shapes import param_count

PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", group_options("model"))
def test_meta_model_matches_closed_form(name: str) -> None:
    m = compose([f"model={name}"]).cfg.model
    model = model_spec(m).build(m, rope_len=16, device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == param_count(m)
    if name in PUBLISHED:
        assert counted == PUBLISHED[name]


def test_published_models_all_ship() -> None:
    assert set(PUBLISHED) <= set(group_options("model"))
