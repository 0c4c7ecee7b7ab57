"""DPO's reference forward under expert and context parallel (dtlaunch.plan.objective): the running layer's
all-to-all dispatch / combine buffers and ring attention's gathered K/V are a moment of the no-grad
forward of their own, apart from its logits moment; the policy's backward exchanges K/V for both rows of
each pair. Hand-computed byte counts; against real gloo runs: bench/planner_accuracy.py --dpo."""

from __future__ import annotations

import dataclasses

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.objective import PHASE_REFERENCE
from dtlaunch.plan.stage import backward_peak, forward_lines, plan_stage, stage_shape, static_lines

# 2 ranks, 4 pairs of 128 tokens: 8 rows, 1,024 tokens a micro-step; ZeRO-3, fp32; the head over the whole
# micro-batch (the chunked head: tests/unit/test_plan_objective.py).
BASE = [
    "training.loss_chunks=1",
    "training.micro_batch=4",
    "training.seq_len=128",
    "launch.nproc_per_node=2",
    "strategy=zero3",
    "objective=dpo",
    "plan.moe_imbalance=1.0",
]
ROWS_TOKENS = 2 * 4 * 128
E = 4  # fp32


def shape(*overrides: str):
    job = load_job([*BASE, *overrides])
    n = int(job.cfg.model.n_layers)
    return job, stage_shape(job.cfg, job.layout, 0, n, True, True)


def reference_transient(*overrides: str) -> float:
    """The reference forward phase over what the rank holds for the whole step."""
    job, c = shape(*overrides)
    n = int(job.cfg.model.n_layers)
    stage = plan_stage(job.cfg, job.layout, 0, n, True, True)
    return stage.phases[PHASE_REFERENCE] - sum(static_lines(c).values())


def gathered_root(vocab: int, dim: int = 256) -> float:
    """ZeRO-3: the copy's root unit (embedding, head, final norm) gathered for the forward."""
    return E * (2 * vocab * dim + dim)


@pytest.mark.parametrize("lora", [[], ["peft=lora", "peft.targets=[wq,wk,wv,wo]"]], ids=["copy", "adapters_off"])
def test_expert_parallel_reference_holds_one_layers_all_to_all_buffers(lora: list[str]) -> None:
    # A 64-token vocabulary: the logits moment (8 bytes a token and vocabulary entry, 512 KiB) is below
    # one MoE layer's dispatch / combine buffers: every routed copy (1,024 tokens x top-2) received and
    # regrouped expert-major, 2 x 4 bytes x 256 wide (4 MiB), as in the policy's forward.
    moe = ["model=planner_moe", "model.vocab_size=64", "strategy.ep=2", *lora]
    a2a = 2 * E * ROWS_TOKENS * 2 * 256
    assert shape(*moe)[1].ep == 2
    assert forward_lines(shape(*moe)[1])["all-to-all buffers"] == a2a
    assert reference_transient(*moe) == pytest.approx(a2a + gathered_root(64))
    # Without EP there is no exchange: the logits moment alone.
    no_ep = [o for o in moe if o != "strategy.ep=2"]
    assert reference_transient(*no_ep) == pytest.approx(8 * 64 * ROWS_TOKENS + gathered_root(64))


def test_expert_parallel_buffers_do_not_add_to_the_logits_moment() -> None:
    # planner_moe's 2,048-token vocabulary: the logits moment (16 MiB) is the larger; no grad frees the
    # last layer's buffers before the head runs, so EP leaves the reference's transient as it is.
    with_ep = reference_transient("model=planner_moe", "strategy.ep=2")
    assert with_ep == pytest.approx(8 * 2048 * ROWS_TOKENS + gathered_root(2048))
    assert with_ep == pytest.approx(reference_transient("model=planner_moe"))


@pytest.mark.parametrize("lora", [[], ["peft=lora"]], ids=["copy", "adapters_off"])
def test_context_parallel_reference_holds_one_layers_gathered_kv(lora: list[str]) -> None:
    # CP(2): 512 local tokens; each attention gathers both rows of every pair at full length (1,024
    # tokens) of K and V repeated to the 8 query heads x 32 (planner7m: 4 K/V heads), 4 bytes: 2 MiB, over
    # a 64-token vocabulary's 256 KiB logits moment.
    cp = ["model=planner7m", "model.vocab_size=64", "strategy.cp=2", *lora]
    kv = 2 * E * 256 * ROWS_TOKENS
    assert reference_transient(*cp) == pytest.approx(kv + gathered_root(64))
    # At planner7m's 2,048 entries the logits moment (8 MiB on 512 tokens) is the larger again.
    big = reference_transient("model=planner7m", "strategy.cp=2", *lora)
    assert big == pytest.approx(8 * 2048 * ROWS_TOKENS / 2 + gathered_root(2048))


def test_context_parallel_backward_exchanges_both_rows_of_each_pair() -> None:
    # The policy's backward at a block: K/V of the whole sequence and their fp32 gradients for all 8 rows
    # (2 x (4 + 4) bytes x 256 x 1,024 tokens), not for one row per sample.
    job, c = shape("model=planner7m", "strategy.cp=2", "training.activation_checkpointing=full")
    lines = {**static_lines(c), **forward_lines(c)}
    without = backward_peak(dataclasses.replace(c, cp=1), lines)
    assert backward_peak(c, lines) - without == pytest.approx(2 * (E + 4) * 256 * ROWS_TOKENS)
