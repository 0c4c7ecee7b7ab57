"""dtlaunch's memory plan for LoRA / QLoRA jobs next to the peak memory torchtune publishes for them.

Source of the published figures: pytorch/torchtune README (Llama 3.1 fine-tuning table: batch 2, packed
2048-token sequences, torch.compile on). Each "same job" row restates that job as dtlaunch overrides (same
model, method, GPU count, micro-batch, sequence length, compile; LoRA rank 8 / alpha 16 on q, v, output
projections and the MLP, as torchtune's Llama-3.1 configs; activation checkpointing on, as their
single-device and distributed LoRA configs ship). dtlaunch's figures: planned peak allocated bytes, and
planned reserved = allocated x (1 + hardware.fragmentation). Which allocator statistic torchtune's table
reports is not stated there.

Where the jobs differ (the same model and batch, not the same program):
- loss: torchtune computes cross-entropy in chunks of the sequence (its Llama-3 recipes' chunked loss),
  so fp32 logits over the 128,256-token vocabulary never exist whole; dtlaunch's loss upcasts the whole
  logits (the "loss/backward buffers" line: 8 bytes x vocabulary per token at its backward);
- dtypes: torchtune holds the whole model, adapters and AdamW state in bf16; dtlaunch stores the frozen
  linears in bf16 (NF4 under QLoRA) but keeps the embedding, norm gains, adapters and their AdamW state in
  fp32 (mixed precision with fp32 master weights);
- the recipe rows are dtlaunch's shipped recipes (recipes/), planned as they are.

    python bench/peft_compare.py [--json out.json] [--markdown bench/results/peft-compare.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table

GIB = 2**30
SOURCE = "pytorch/torchtune README, Llama 3.1 fine-tuning memory and speed table"
JOB = [
    "precision=bf16",
    "data=synthetic",
    "training.micro_batch=2",
    "training.global_batch=2",
    "training.seq_len=2048",
    "training.activation_checkpointing=full",
    "training.compile=true",
]
ONE_4090 = ["strategy=ddp", "launch.nproc_per_node=1", "hardware=rtx4090_24gb"]
EIGHT_A100 = ["strategy=fsdp", "launch.nproc_per_node=8", "hardware=a100_80gb", "training.global_batch=16"]


@dataclass(frozen=True)
class Row:
    job: str
    overrides: tuple[str, ...]
    published_gib: float | None = None  # torchtune's peak memory per GPU for the same job
    recipe: str = ""


ROWS = (
    Row("Llama-3.1-8B LoRA, 1x RTX 4090 (same job)", ("model=llama3_8b", "peft=lora", *ONE_4090, *JOB), 16.2),
    Row("Llama-3.1-8B QLoRA, 1x RTX 4090 (same job)", ("model=llama3_8b", "peft=qlora", *ONE_4090, *JOB), 7.4),
    Row("Llama-3.1-70B LoRA, 8x A100 (same job)", ("model=llama3_70b", "peft=lora", *JOB, *EIGHT_A100), 27.6),
    Row("Llama-3.1-70B QLoRA, 8x A100 (same batch)", ("model=llama3_70b", "peft=qlora", *JOB, *EIGHT_A100)),
    Row("recipe llama3_8b_lora", ("recipe=llama3_8b_lora",), recipe="llama3_8b_lora"),
    Row("recipe llama3_8b_qlora", ("recipe=llama3_8b_qlora",), recipe="llama3_8b_qlora"),
    Row("recipe qwen3_8b_lora_fsdp", ("recipe=qwen3_8b_lora_fsdp",), recipe="qwen3_8b_lora_fsdp"),
    Row("recipe llama3_70b_qlora_fsdp", ("recipe=llama3_70b_qlora_fsdp",), recipe="llama3_70b_qlora_fsdp"),
)
# Plan lines shown per row: what the fine-tuning terms and the main differences from torchtune cost.
SHOWN = ("parameters", "NF4 base weights", "adapter parameters", "optimizer state", "loss/backward buffers")


def plan_row(row: Row) -> dict:
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    job = load_job(list(row.overrides))
    plan = plan_memory(job.cfg, job.layout)
    reserved = plan.peak * (1 + float(job.cfg.hardware.fragmentation))
    return {
        "job": row.job,
        "hardware": plan.hardware,
        "published_gib": row.published_gib,
        "planned_allocated_gib": plan.peak / GIB,
        "planned_reserved_gib": reserved / GIB,
        "device_total_gib": plan.device_total / GIB,
        "capacity_gib": plan.capacity / GIB,
        "fits": plan.fits,
        "lines_gib": {k: plan.worst.lines[k] / GIB for k in SHOWN if k in plan.worst.lines},
        "overrides": list(row.overrides),
    }


def table(rows: list[dict]) -> str:
    def lines(r: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in r["lines_gib"].items())

    return markdown_table(
        ["job", "hardware", "torchtune GiB", "dtlaunch planned GiB", "device total / capacity", "fits", "lines (GiB)"],
        [
            [
                r["job"],
                r["hardware"],
                "-" if r["published_gib"] is None else f"{r['published_gib']:.1f}",
                f"{r['planned_reserved_gib']:.1f} reserved ({r['planned_allocated_gib']:.1f} allocated)",
                f"{r['device_total_gib']:.1f} / {r['capacity_gib']:.1f}",
                "yes" if r["fits"] else "no",
                lines(r),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    args = ap.parse_args(argv)
    rows = [plan_row(r) for r in ROWS]
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"source": SOURCE, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        doc = (__doc__ or "").split("    python bench/")[0].strip()
        head = [
            "# dtlaunch plan vs torchtune's published fine-tuning peak memory (Llama 3.1)",
            "",
            f"Published figures: {SOURCE}.",
            "Reproduce: `python bench/peft_compare.py --markdown bench/results/peft-compare.md`.",
            "",
            text,
            "",
            "## About the comparison",
            "",
            *doc.splitlines()[2:],
            "",
        ]
        Path(args.markdown).write_text("\n".join(head))


if __name__ == "__main__":
    main()
