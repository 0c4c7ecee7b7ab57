"""strategy.ep without torch: layout rules with one-line errors, the planner's EP sharding and all-to-all
buffers, ep degrees in the layout search, and the qwen3_30b_a3b recipe's plan."""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.models.moe.shapes import routed_params
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.search import search

MOE = ["model=tiny_moe", "strategy=zero3"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=tiny", "strategy=zero3", "launch.nproc_per_node=2", "strategy.ep=2"], "has none: use strategy.ep=1"),
        ([*MOE, "launch.nproc_per_node=3", "strategy.ep=3"], "does not divide model.moe.num_experts=8"),
        (
            ["model=tiny_moe", "strategy=fsdp", "strategy.zero_stage=0", "launch.nproc_per_node=2", "strategy.ep=2"],
            "set strategy.zero_stage=2 or 3",
        ),
        (
            [*MOE, "launch.nproc_per_node=4", "strategy.dp_shard=2", "strategy.dp_replicate=2", "strategy.ep=4"],
            "strategy.dp_shard=2",
        ),
        ([*MOE, "launch.nproc_per_node=2", "strategy.ep=0"], "strategy.ep=0 is out of range"),
        ([*MOE, "launch.nproc_per_node=4", "strategy.cp=2", "strategy.ep=2"], "with strategy.cp=2 is not supported"),
    ],
    ids=["dense-model", "experts", "ddp", "dp-shard", "range", "cp"],
)
def test_layout_rules_name_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_job(overrides)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_ep_with_hsdp_validates_and_ep_with_tp_is_refused() -> None:
    """EP over HSDP's shard ranks runs; EP with TP would split the experts twice (TP already splits each
    expert's width: dtlaunch.models.moe.tp_plan), refused in one line naming both fixes."""
    job = load_job([*MOE, "launch.nproc_per_node=8", "strategy.dp_replicate=2", "strategy.ep=2"])
    assert (job.layout.dp_shard, job.layout.ep, job.layout.tp) == (4, 2, 1)
    with pytest.raises(ConfigError) as err:
        load_job([*MOE, "launch.nproc_per_node=8", "strategy.dp_replicate=2", "strategy.tp=2", "strategy.ep=2"])
    text = str(err.value)
    assert "\n" not in text and "strategy.tp=2 with strategy.ep=2" in text and "set strategy.ep=1" in text, text


def _plan(*overrides: str):
    job = load_job(
        ["model=qwen3_30b_a3b", "hardware=h100_80gb", "precision=bf16", "launch.nproc_per_node=8", *overrides]
    )
    return job, plan_memory(job.cfg, job.layout)


def test_ep_shards_what_fsdp_gathers_and_adds_all_to_all_buffers() -> None:
    # ZeRO-2 keeps a whole unsharded copy of the parameters: under EP only this rank's 1/ep of the experts.
    common = [
        "strategy=zero2",
        "training.micro_batch=1",
        "training.seq_len=4096",
        "training.activation_checkpointing=full",
        "training.loss_chunks=8",  # the same loss either way (auto: the full pass where it fits, EP=8 only)
    ]
    job, ep1 = _plan(*common)
    _, ep8 = _plan(*common, "strategy.ep=8")
    m = job.cfg.model
    routed = routed_params(m) * m.n_layers
    a, b = ep1.worst.lines, ep8.worst.lines
    # Sharded model states are those of FSDP over all 8 ranks either way.
    for key in ("parameters", "optimizer state"):
        assert a[key] == b[key], key
    assert a["unsharded parameters"] - b["unsharded parameters"] == pytest.approx(2 * (routed - routed // 8))
    assert "all-to-all buffers" not in a
    # Routed copies the busiest rank receives: the balanced share times the rank imbalance, which goes
    # from 1 (one rank, all experts) to plan.moe_imbalance (one expert a rank) with the EP degree.
    rank_imbalance = 1 + (job.cfg.plan.moe_imbalance - 1) * (8 - 1) / (m.moe.num_experts - 1)
    copies = 4096 * m.moe.top_k * rank_imbalance
    assert b["all-to-all buffers"] == pytest.approx(2 * 2 * copies * m.dim)
    assert ep8.layout["ep"] == 8


def test_recipe_plans_and_fits() -> None:
    job = load_job(["recipe=qwen3_30b_a3b"])
    plan = plan_memory(job.cfg, job.layout)
    assert job.layout.ep == 8 and job.layout.dp_shard == 8 and plan.fits
    assert 60 * 2**30 < plan.device_total < job.cfg.hardware.memory_gib * 2**30


def test_search_includes_ep_degrees() -> None:
    job = load_job(["recipe=qwen3_30b_a3b"])
    rows = search(job.cfg, top=50)
    degrees = {r["ep"] for r in rows}
    assert len(degrees - {1}) >= 2 and 1 in degrees, degrees
    # Tensor parallel splits the experts' width instead (never with EP: check_moe_tensor_parallel).
    assert any(r["tp"] > 1 for r in rows) and all(r["ep"] == 1 for r in rows if r["tp"] > 1)
    best = rows[0]
    assert best["ep"] > 1 and f"strategy.ep={best['ep']}" in best["overrides"]
    # No degree that leaves experts unevenly split or takes more ranks than dp_shard.
    assert all(8 % r["ep"] == 0 and r["dp_shard"] % r["ep"] == 0 for r in rows)
