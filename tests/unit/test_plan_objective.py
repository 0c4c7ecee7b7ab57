"""The memory plan of preference tuning (dtlaunch.plan.objective): pairs double the activations, a full
fine-tuning DPO run holds a frozen reference copy (sharded under FSDP), LoRA's adapters-off reference and
a precomputed one hold none, and the precompute pass is a phase of its own. (Against measured peaks of
real runs: bench/planner_accuracy.py --dpo.)"""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.lines import Line
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.objective import PHASE_PRECOMPUTE, PHASE_REFERENCE

BASE = ["model=planner7m", "training.micro_batch=4", "training.seq_len=128", "launch.nproc_per_node=2"]


def plan(*overrides: str):
    job = load_job([*BASE, *overrides])
    return plan_memory(job.cfg, job.layout).worst


@pytest.mark.parametrize("strategy", ["strategy=ddp", "strategy=zero3"])
def test_pairs_double_the_activations_and_the_copy_is_held(strategy: str) -> None:
    # Both with one full-vocabulary pass (the chunked log-probs: test_preference_chunks_drop_the_logits).
    sft, dpo = plan(strategy, "training.loss_chunks=1"), plan(strategy, "objective=dpo", "training.loss_chunks=1")
    assert sft.phases["forward"] < dpo.phases["forward"]
    act = "activations"
    assert dpo.lines.get(act, 0) == pytest.approx(2 * sft.lines.get(act, 0), rel=0.01) or dpo.phase != sft.phase
    copy = dpo.lines[Line.REFERENCE_COPY]
    assert copy > 0 and PHASE_REFERENCE in dpo.phases
    if strategy == "strategy=zero3":  # sharded like the policy: half of DDP's replica on 2 ranks
        assert copy == pytest.approx(plan("strategy=ddp", "objective=dpo").lines[Line.REFERENCE_COPY] / 2)


def test_lora_and_precomputed_references_hold_no_copy(tiny_tokenizer, tmp_path) -> None:
    lora = plan("strategy=zero3", "objective=dpo", "peft=lora")
    assert Line.REFERENCE_COPY not in lora.lines and PHASE_REFERENCE in lora.phases
    (tmp_path / "p.jsonl").write_text('{"prompt": "kaka", "chosen": " lolo", "rejected": " mimi"}\n')
    pre = plan(
        "strategy=zero3",
        "objective=dpo",
        "objective.precompute_reference=true",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={tmp_path / 'p.jsonl'}",
        f"data.tokenizer={tiny_tokenizer / 'tokenizer.json'}",
    )
    assert Line.REFERENCE_COPY not in pre.lines and PHASE_REFERENCE not in pre.phases
    assert 0 < pre.phases[PHASE_PRECOMPUTE] < pre.peak


def test_reference_free_objectives_plan_pairs_only() -> None:
    orpo = plan("strategy=zero3", "objective=orpo")
    assert Line.REFERENCE_COPY not in orpo.lines and PHASE_REFERENCE not in orpo.phases
    assert orpo.phases["forward"] > plan("strategy=zero3").phases["forward"]


def test_expert_parallel_dpo_counts_both_rows_in_the_all_to_all_and_shards_the_copy() -> None:
    moe = ["model=planner_moe", "strategy=zero3", "training.loss_chunks=1"]
    sft, dpo = plan(*moe, "strategy.ep=2"), plan(*moe, "strategy.ep=2", "objective=dpo")
    a2a = "all-to-all buffers"
    assert dpo.lines[a2a] == pytest.approx(2 * sft.lines[a2a])  # a pair's two rows are routed
    # The copy's experts split over EP then FSDP over the shard ranks left: per rank, as ZeRO-3 alone.
    assert dpo.lines[Line.REFERENCE_COPY] == pytest.approx(plan(*moe, "objective=dpo").lines[Line.REFERENCE_COPY])
    assert PHASE_REFERENCE in dpo.phases


def test_context_parallel_dpo_splits_both_rows_and_shards_the_copy_over_cp() -> None:
    # CP=2 holds half of each pair's rows (tokens) where DP=2 holds whole pairs; the copy is FSDP-sharded
    # over dp_shard x cp, so 2 ranks hold half each either way.
    dp, cp = plan("strategy=zero3", "objective=dpo"), plan("strategy=zero3", "objective=dpo", "strategy.cp=2")
    assert cp.lines["activations"] == pytest.approx(dp.lines["activations"] / 2, rel=0.01)
    assert cp.lines[Line.REFERENCE_COPY] == pytest.approx(dp.lines[Line.REFERENCE_COPY])
    assert 0 < cp.phases[PHASE_REFERENCE] < dp.phases[PHASE_REFERENCE]


def _stages(*overrides: str) -> list:
    job = load_job([*BASE, *overrides])
    return plan_memory(job.cfg, job.layout).stages


def _held(stage) -> float:
    """What the rank holds through the whole step (the reference forward adds its buffers to it)."""
    keys = ("parameters", "adapter parameters", "buffers", "optimizer state", Line.REFERENCE_COPY)
    return sum(v for k, v in stage.lines.items() if k in keys)


def test_pipeline_dpo_splits_the_reference_into_the_stages() -> None:
    # Each pipeline rank holds the copy of its own stage: together, DDP's one whole copy.
    first, last = _stages("strategy=pp", "objective=dpo")
    whole = plan("strategy=ddp", "objective=dpo").lines[Line.REFERENCE_COPY]
    assert first.lines[Line.REFERENCE_COPY] + last.lines[Line.REFERENCE_COPY] == pytest.approx(whole, rel=1e-9)
    # The last stage's reference forward holds the logits; the first only the hidden states it sends on.
    assert last.phases[PHASE_REFERENCE] - _held(last) > first.phases[PHASE_REFERENCE] - _held(first) > 0
    # LoRA's reference is the policy's own stages with their adapters off: no copy.
    lora = _stages("strategy=pp", "objective=dpo", "peft=lora")
    assert all(Line.REFERENCE_COPY not in s.lines and PHASE_REFERENCE in s.phases for s in lora)


def test_pipeline_dpo_precompute_pass_runs_through_the_stages(tiny_tokenizer, tmp_path) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "kaka", "chosen": " lolo", "rejected": " mimi"}\n')
    data = [
        "objective=dpo",
        "objective.precompute_reference=true",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={tmp_path / 'p.jsonl'}",
        f"data.tokenizer={tiny_tokenizer / 'tokenizer.json'}",
    ]
    pre, live = _stages("strategy=pp", *data), _stages("strategy=pp", "objective=dpo")
    for p, q in zip(pre, live, strict=True):
        assert Line.REFERENCE_COPY not in p.lines and PHASE_REFERENCE not in p.phases
        # The pass holds the stage's copy and runs its forward, before any optimizer state exists.
        held = q.phases[PHASE_REFERENCE] - q.lines["optimizer state"]
        assert p.phases[PHASE_PRECOMPUTE] == pytest.approx(held, rel=1e-6)
    # Both rows of each pair in the pipeline's activations.
    assert plan("strategy=pp", "objective=orpo").phases["forward"] > plan("strategy=pp").phases["forward"]


def test_layout_search_offers_pipelines_to_every_objective() -> None:
    from dtlaunch.plan.search import candidates

    def pipelines(*overrides: str) -> bool:
        job = load_job([*BASE, "launch.nproc_per_node=4", *overrides])
        return any(lay.pp > 1 for lay, _, _ in candidates(job.cfg))

    assert pipelines("objective=simpo") and pipelines("objective=orpo")
    assert pipelines("objective=dpo") and pipelines(
        "objective=dpo", "peft=lora"
    )  # the reference runs through the stages


@pytest.mark.parametrize("lora", [[], ["peft=lora"]], ids=["copy", "adapters_off"])
def test_preference_chunks_drop_the_logits(lora: list[str]) -> None:
    # training.loss_chunks: the policy's log-probs and the reference's come from the head run over 1/8 of
    # the tokens at a time, so neither holds the micro-batch's logits.
    full = plan("strategy=zero3", "objective=dpo", "training.loss_chunks=1", *lora)
    chunked = plan("strategy=zero3", "objective=dpo", "training.loss_chunks=8", *lora)
    assert chunked.phases["backward"] < full.phases["backward"]
    assert chunked.phases[PHASE_REFERENCE] < full.phases[PHASE_REFERENCE]


@pytest.mark.parametrize(
    "overrides,chunks",
    [
        ([], 1),  # planner7m's 2k vocabulary: 4 x 128 tokens x 2048 = 1 Mi logits, a full pass
        (["model.vocab_size=131072"], 8),  # 64 Mi logits (256 MiB in fp32): chunked
        (["model.vocab_size=16384"], 1),  # 8 Mi
        (["model.vocab_size=16384", "training.seq_len=256"], 8),  # 16 Mi: the threshold
        (["model.vocab_size=8192", "objective=dpo"], 1),  # a pair's two rows: 8 Mi
        (["model.vocab_size=8192", "objective=dpo", "training.micro_batch=8"], 8),
        (["model.vocab_size=131072", "training.loss_chunks=1"], 1),  # what the command line says
        (["training.loss_chunks=4"], 4),
        (["model.vocab_size=131072", "objective=reward"], 1),  # a scalar head: no vocabulary to chunk
    ],
)
def test_auto_loss_chunks_chunk_only_large_logits(overrides: list[str], chunks: int) -> None:
    """training.loss_chunks=0 (the default): one decision (config.decisions.Decisions.loss_chunks) the planner and the
    loss both read, from one rank's micro-batch logits."""
    job = load_job([*BASE, *overrides])
    assert int(job.cfg.training.loss_chunks) == (0 if not any("loss_chunks" in o for o in overrides) else chunks)
    assert job.decisions.loss_chunks == chunks
