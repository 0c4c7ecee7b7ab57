"""`plan --search` prints only layouts the config rules accept: validate judges every row it prints."""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.job import validate as validate_module
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


def test_ulysses_hybrid_offers_the_cp_degrees_its_key_heads_take() -> None:
    """A Gated DeltaNet hybrid has no ring attention; under strategy.cp_style=ulysses the search offers the CP
    degrees (and the tensor-parallel degrees beside each) whose ranks get whole key heads: the rule validate
    enforces (qwen3_next/check.py, registry `ulysses_degree_ok`). 4 key heads on 8 ranks: cp 2 with tp 1 or 2,
    cp 4 with tp 1 only, never cp 8."""
    from dtlaunch.models.qwen3_next.check import cp_divides_key_heads
    from dtlaunch.models.registry import model_spec
    from dtlaunch.plan.search import candidates, cp_degrees

    base = ["model=tiny", "model.arch=qwen3_5", "model.qk_norm=true", "model.linear_num_key_heads=4"]
    base += ["model.linear_num_value_heads=8", "launch.nproc_per_node=8", "training.seq_len=256"]
    cfg = load_job([*base, "strategy.cp_style=ulysses"]).cfg
    assert model_spec(cfg.model).ulysses_degree_ok is cp_divides_key_heads
    assert cp_degrees(cfg) == [1, 2, 4]
    assert {lay.tp for lay, _, _ in candidates(cfg, 2)} == {1, 2}
    assert {lay.tp for lay, _, _ in candidates(cfg, 4)} == {1}
    assert cp_degrees(load_job([*base, "strategy.cp_style=ring"]).cfg) == [1]  # validate refuses ring CP for it
    try:
        load_job([*base, "strategy.cp_style=ulysses", "strategy.cp=4", "strategy.tp=2", "strategy.dp_shard=1"])
    except ConfigError as err:
        assert "linear_num_key_heads" in str(err), err
    else:
        raise AssertionError("validate took cp=4 over 2 key heads per tensor-parallel rank")


def test_planning_fastest_first_prints_what_planning_every_candidate_would() -> None:
    """search() plans candidates in order of a lower bound of their step time and stops at `top` rows; the
    rows (and their order) equal those of planning every candidate, sorting and validating them, here on a
    job where offloading, several AC modes and pipelined layouts compete."""
    from dtlaunch.plan import search as s

    cfg = load_job(["model=llama3_70b", "launch.nproc_per_node=8", "hardware=h100_80gb"]).cfg
    plain = s._plain(cfg)
    fitted: set = set()
    every = [s._planned_row(plain, *c, fitted) for cp in s.cp_degrees(plain) for c in s.candidates(plain, cp)]
    rows = sorted((r for r in every if r is not None), key=lambda r: (r["step_s"], r["device_total_bytes"]))
    expected = [r["overrides"] for r in rows if s._accepted(cfg, r)][:10]
    got = search(cfg, top=10)
    assert [r["overrides"] for r in got] == expected
    assert any(r["activation_offload"] or r["cpu_offload"] for r in got)  # the offload variants took part


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama3_70b", "launch.nproc_per_node=8", "hardware=h100_80gb"],
        ["recipe=qwen3_30b_a3b"],
        ["recipe=qwen3_8b_dpo_fsdp"],
        ["recipe=gpt_oss_20b_lora"],
    ],
    ids=["70b-8gpu", "moe", "dpo", "lora-one-gpu"],
)
def test_the_variant_that_offloads_the_most_leaves_the_most_device_headroom(overrides: list[str]) -> None:
    """search skips a candidate whose last offload variant (activations and CPU offload, as allowed) leaves
    no device headroom, without planning the others: exact only while no lighter variant leaves more. Every
    third candidate with variants, every variant (seconds; checked on every shipped recipe when written)."""
    from dtlaunch.plan import search as s
    from dtlaunch.plan.offload import offload_variants

    plain = s._plain(load_job(overrides).cfg)
    checked = 0
    for n, (lay, st, tr) in enumerate(c for cp in s.cp_degrees(plain) for c in s.candidates(plain, cp)):
        variants = offload_variants(plain, lay, st, tr)
        if len(variants) < 2 or n % 3:
            continue
        room = [s._variant_plan(plain, lay, st, tr, v)[2].headroom for v in variants]
        assert max(room[:-1]) <= room[-1] + 1, (lay, st, tr, variants, room)
        checked += 1
    assert checked > 3
