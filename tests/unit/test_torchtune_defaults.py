"""torchtune's five published Llama-3.1 fine-tuning peaks against dtlaunch's plan: each row is a shipped
recipe plus torchtune's own job settings (model, method, GPUs, batch 2 x 2048, compile, full AC; the full
fine-tunes' CPU offload). Four need no memory saver on the command line: the saver the defaults turn on
(activation offload under full AC, config.decisions.Decisions.activation_offload) costs no step time by the plan's
step-time model. The 70B full fine-tune is the exception: under strategy.cpu_offload the host link is
already busy, so the default leaves activation offload off (it would add its copies to the step) and the
row names it. Published figures: pytorch/torchtune README (bench/results/peft-compare.md)."""

from __future__ import annotations

import copy

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.memory import GIB, plan_memory
from dtlaunch.plan.search import step_time

# torchtune's loss is CEWithChunkedOutputLoss, 8 chunks (dtlaunch's auto would take the full pass where it fits).
BATCH = ["training.micro_batch=2", "training.seq_len=2048", "training.loss_chunks=8"]
FULL = [*BATCH, "training.activation_checkpointing=full", "training.compile=true", "strategy.cpu_offload=true"]
ROWS = {
    "8B LoRA, 1 x RTX 4090": (16.2, ["recipe=llama3_8b_lora", *BATCH, "training.global_batch=2"]),
    "8B QLoRA, 1 x RTX 4090": (7.4, ["recipe=llama3_8b_qlora", *BATCH, "training.global_batch=2"]),
    "70B LoRA, 8 x A100": (
        27.6,
        ["recipe=llama3_70b_qlora_fsdp", "peft=lora", "training.compile=true", *BATCH, "training.global_batch=16"],
    ),
    "8B full, 1 x RTX 4090": (
        18.9,
        ["recipe=llama8b_fsdp", "hardware=rtx4090_24gb", "launch.nproc_per_node=1", *FULL, "training.global_batch=2"],
    ),
    "70B full, 8 x A100": (
        13.9,
        ["recipe=llama8b_fsdp", "model=llama3_70b", "hardware=a100_80gb", *FULL, "training.global_batch=16"],
    ),
}
# Rows whose default leaves a saver off because it would cost step time, with the override that meets the figure.
NOT_FREE = {"70B full, 8 x A100": "training.activation_offload=true"}


@pytest.mark.parametrize("row", list(ROWS))
def test_torchtune_row_at_or_under_its_peak_with_defaults(row: str) -> None:
    published, args = ROWS[row]
    if row in NOT_FREE:
        job = load_job(args)
        assert not job.decisions.activation_offload and not plan_memory(job.cfg, job.layout).peak / GIB <= published
        args = [*args, NOT_FREE[row]]
    job = load_job(args)
    plan = plan_memory(job.cfg, job.layout)
    assert plan.fits and plan.peak / GIB <= published, (row, plan.peak / GIB)
    if row in NOT_FREE or not job.decisions.activation_offload:
        return
    kept = copy.deepcopy(job.cfg)
    kept.training.activation_offload = False
    moved = plan_memory(kept, job.layout).worst.lines["activations"] - plan.worst.lines.get("activations", 0.0)
    on = step_time(job.cfg, job.layout, 1, 1, moved)
    off = step_time(kept, job.layout, 1, 1, 0.0)
    assert moved > 0 and on["total"] == off["total"]  # the default's saver costs nothing by the step-time model
