"""`plan --search` prints only layouts the config rules accept: validate judges every row it prints."""

from __future__ import annotations

from dtlaunch.commands.common import load_job
from dtlaunch.config import validate as validate_module
from dtlaunch.errors import ConfigError
from dtlaunch.plan.search import search


def test_moe_recipe_rows_name_their_expert_degree_and_each_validates() -> None:
    """qwen3_30b_a3b sets strategy.ep=8; a row with ep=1 (a pipeline layout) that left `strategy.ep` out of
    its overrides kept the recipe's 8 when pasted, and validate refused it (ZeRO-0 under EP)."""
    rows = search(load_job(["recipe=qwen3_30b_a3b"]).cfg, top=4)
    assert rows
    for row in rows:
        assert any(o.startswith("strategy.ep=") for o in row["overrides"]), row["overrides"]
        load_job(["recipe=qwen3_30b_a3b", *row["overrides"]])  # raises ConfigError if refused


def test_a_rule_the_search_does_not_know_still_removes_its_rows(monkeypatch) -> None:
    """A rule only validate has (here: no pipeline at all) removes the rows it refuses; the search fills
    `top` with the next-fastest layouts that pass."""
    cfg = load_job(["recipe=tiny_3d"]).cfg
    assert any(r["pp"] > 1 for r in search(cfg, top=10)), "the job needs a pipelined layout in its top 10"

    def no_pipeline(cfg, notes) -> None:
        if int(cfg.strategy.pp) > 1:
            raise ConfigError(f"strategy.pp={cfg.strategy.pp}: refused by this test's rule; set strategy.pp=1")

    monkeypatch.setattr(validate_module, "SIMPLE_RULES", [*validate_module.SIMPLE_RULES, no_pipeline])
    rows = search(cfg, top=10)
    assert len(rows) == 10 and all(r["pp"] == 1 for r in rows)
