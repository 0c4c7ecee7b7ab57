"""`plan --maximize` turns on the memory savers the job leaves open (dtlaunch.plan.maximize.SAVERS): the
cheapest combination that reaches the largest value, each saver through the config's own rules and the
host's RAM, none that the command line sets (issue 47). Planner only: no torch."""

from __future__ import annotations

import pytest
from cli_in_process import run_cli

from dtlaunch.commands.common import load_job
from dtlaunch.plan.maximize import SAVERS, maximize
from dtlaunch.plan.memory import plan_memory

# The job's shape only: Llama-3.1-8B full fine-tune, one sequence a step, the search capped far away.
SHAPE = ["training.micro_batch=1", "training.global_batch=1", "model.max_seq_len=8000000"]
ONE_H100 = ["recipe=llama8b_fsdp", "launch.nproc_per_node=1", "precision=bf16", *SHAPE]
EIGHT_H100_CP = ["recipe=llama8b_fsdp", "strategy.cp=8", "strategy.dp_shard=1", "precision=bf16", *SHAPE]
SEARCHED = {s.key for s in SAVERS}


def _fits(args: list[str]) -> bool:
    job = load_job(args)
    return plan_memory(job.cfg, job.layout, all_stages=False).fits


@pytest.fixture(scope="module")
def one_h100():
    return maximize(load_job(ONE_H100).cfg, "training.seq_len")


def test_one_gpu_full_finetune_reaches_past_alst(one_h100) -> None:
    """Without savers not one token fits (parameters, gradients and AdamW state of 8B are 120 GiB); the
    search turns on CPU offload, activation offload and full checkpointing, and passes ALST's published
    500,000 tokens for Llama-3.1-8B on one H100 (the README's row)."""
    found = one_h100
    assert found.value is not None and found.value >= 500_000, found
    for saver in (
        "strategy.cpu_offload=true",
        "training.activation_offload=true",
        "training.activation_checkpointing=full",
    ):
        assert saver in found.savers
    at = [*ONE_H100, found.override, *found.savers]
    assert _fits(at)
    # The edge is the memory's: the next candidate with the same savers (the chunk and tile counts at it
    # would only be larger, saving more) does not fit.
    assert not _fits([*at, f"training.seq_len={found.value + 1}"])


def test_each_searched_saver_is_needed_at_the_value(one_h100) -> None:
    """The cheapest combination: switching off any saver the search turned on loses the value."""
    found = one_h100
    searched = [s for s in found.savers if s.split("=")[0] in SEARCHED]
    assert len(searched) >= 3
    base = load_job(ONE_H100).cfg
    for saver in searched:
        key = saver.split("=")[0]
        back = f"{key}={_own(base, key)}"
        rest = [s for s in found.savers if s != saver and not s.startswith("training.mlp_tiles=")]
        assert not _fits([*ONE_H100, found.override, *rest, back]), saver


def _own(cfg, key: str) -> str:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def test_eight_gpus_context_parallel_reaches_past_alst() -> None:
    """The README's 8-GPU row, past ALST's published 3,700,000 tokens on 8 H100s: the command line gives the
    job's shape only, on the h100_80gb profile's own 2,048 GiB, and the savers the search turned on (Ulysses,
    CPU offload, activation offload, full AC) are printed in the override to paste."""
    code, out = run_cli(["plan", *EIGHT_H100_CP, "--maximize", "training.seq_len"], stdout=True)
    text = " ".join(out.split())  # (the console wraps long lines)
    assert code == 0 and "of 2,048.00 GiB host RAM per node" in text
    value = int(text.split("largest training.seq_len that fits: ")[1].split()[0])
    assert value >= 3_700_000, text
    paste = text.split("override to paste: ")[1].split()
    assert paste[:2] == [f"training.seq_len={value}", "strategy.cp_style=ulysses"]
    for saver in (
        "strategy.cpu_offload=true",
        "training.activation_offload=true",
        "training.activation_checkpointing=full",
    ):
        assert saver in paste


def test_host_ram_bounds_the_savers() -> None:
    """CPU offload holds 8B's fp32 parameters and AdamW state (~90 GiB) on the host: with 64 GiB it cannot
    be chosen and nothing fits; with 160 GiB it is, and the offloaded activations stop where the host is full."""
    none = maximize(load_job([*ONE_H100, "hardware.host_memory_gib=64"]).cfg, "training.seq_len")
    assert none.value is None
    found = maximize(load_job([*ONE_H100, "hardware.host_memory_gib=160"]).cfg, "training.seq_len")
    assert found.value is not None and "strategy.cpu_offload=true" in found.savers
    assert found.plan.host_fits and found.plan.host_total > 0.9 * found.plan.host_capacity


def test_what_the_command_line_sets_is_not_searched() -> None:
    """Selective checkpointing on the command line stays selective (the recipe's own value would not be
    pinned); the other savers are still searched, and the job fits a shorter sequence than with full AC."""
    code, out = run_cli(
        ["plan", *ONE_H100, "training.activation_checkpointing=selective", "--maximize", "training.seq_len"],
        stdout=True,
    )
    text = " ".join(out.split())  # (the console wraps long lines)
    assert code == 0 and "training.activation_checkpointing" not in text, text
    assert "strategy.cpu_offload=true" in text.split("override to paste: ")[1]


def test_a_job_that_fits_at_the_cap_turns_nothing_on() -> None:
    """Savers cost speed: where the job reaches model.max_seq_len as it is, none is named."""
    found = maximize(load_job(["recipe=llama8b_fsdp", "model.max_seq_len=8192"]).cfg, "training.seq_len")
    assert found.value == found.largest == 8192 and found.savers == ()
