"""dtlaunch's memory plan for torchtune's published fine-tuning jobs, next to the peak memory torchtune measured.

Source of the published figures: pytorch/torchtune README (Llama 3.1 fine-tuning table: batch 2, packed
2048-token sequences, torch.compile on, activation checkpointing on). Each job is restated as dtlaunch
overrides like for like: the same model, method, GPU count, micro-batch, sequence length and compile, and
torchtune's adapter choice (8B LoRA: q, v at rank 8; 8B QLoRA: q, k, v, o and the MLP at rank 8; 70B LoRA:
q, k, v at rank 16), with dtlaunch's defaults (chunked loss, 8 chunks; frozen base, embedding and head in
bf16). "+ savers" rows add what dtlaunch offers beyond torchtune's configs, named in the row: bf16 adapter
state, activation offloading (on by default where it costs no step time: full AC on a GPU
profile without CPU offload; named in the rows where the default leaves it off), more loss chunks; the full fine-tunes
use the optimizer settings torchtune used (8-bit AdamW with the step in backward; FSDP CPU offload).
dtlaunch's figures: planned peak allocated bytes, and planned reserved = allocated x (1 +
hardware.fragmentation). Which allocator statistic torchtune's table reports is not stated there.

Where the programs still differ:
- the residual stream: dtlaunch trains with fp32 master weights and, on one GPU, a fp32 hidden state
  between blocks (autocast) unless precision.residual_dtype=bf16, so full activation checkpointing keeps
  4 bytes per hidden value where torchtune's all-bf16 model keeps 2 (1 GiB more for Llama-3.1-8B at
  2 x 2048; activation offloading, on by default there, moves it to the host);
- the 8B full fine-tune: torchtune's bf16 weights have no fp32 master copy and its paged 8-bit AdamW
  state spills to host memory when the GPU is short; dtlaunch keeps fp32 master weights (32 GB for 8B),
  so torchtune's settings do not fit a 24 GB card by the plan. dtlaunch's way onto that card is FSDP CPU
  offload over the one GPU (ZeRO-Offload): the fp32 weights, gradients and AdamW state in host RAM, the
  step on the CPU, a gathered block at a time on the device; it trades host-link traffic and a CPU step
  for the memory;
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
from dtlaunch.plan.lines import Line

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


LORA_8B = ("model=llama3_8b", "peft=lora", "peft.targets=[q_proj,v_proj]", "peft.rank=8", "peft.alpha=16")
QLORA_8B = ("model=llama3_8b", "peft=qlora", "peft.targets=[all-linear]", "peft.rank=8", "peft.alpha=16")
LORA_70B = ("model=llama3_70b", "peft=lora", "peft.targets=[q_proj,k_proj,v_proj]", "peft.rank=16", "peft.alpha=32")
FULL_8B = ("model=llama3_8b", "optim.name=adamw8bit", "optim.in_backward=true", "training.grad_clip=0")
FULL_70B = ("model=llama3_70b", "strategy.cpu_offload=true")
ONE_4090_CPU_OFFLOAD = (
    "strategy=fsdp",
    "launch.nproc_per_node=1",
    "hardware=rtx4090_24gb",
    "strategy.cpu_offload=true",
)
# What dtlaunch adds beyond torchtune's configs (activation offloading is on by default without CPU offload).
BF16_STATE = "optim.state_dtype=bf16"
OFFLOAD = ("training.activation_offload=true", "training.loss_chunks=32")

ROWS = (
    Row("Llama-3.1-8B LoRA, 1x RTX 4090", (*LORA_8B, *ONE_4090, *JOB), 16.2),
    Row(
        "  + bf16 adapter state, activation offload, 32 loss chunks",
        (*LORA_8B, *ONE_4090, *JOB, BF16_STATE, *OFFLOAD),
        16.2,
    ),
    Row("Llama-3.1-8B QLoRA, 1x RTX 4090", (*QLORA_8B, *ONE_4090, *JOB), 7.4),
    Row(
        "  + bf16 adapter state, activation offload, 32 loss chunks",
        (*QLORA_8B, *ONE_4090, *JOB, BF16_STATE, *OFFLOAD),
        7.4,
    ),
    Row("Llama-3.1-70B LoRA, 8x A100", (*LORA_70B, *JOB, *EIGHT_A100), 27.6),
    Row("  + bf16 adapter state", (*LORA_70B, *JOB, *EIGHT_A100, BF16_STATE), 27.6),
    Row("Llama-3.1-8B full, 1x RTX 4090 (8-bit AdamW, step in backward)", (*FULL_8B, *ONE_4090, *JOB), 18.9),
    Row("  instead: FSDP CPU offload on the one GPU", ("model=llama3_8b", *ONE_4090_CPU_OFFLOAD, *JOB), 18.9),
    Row("Llama-3.1-70B full, 8x A100 (FSDP CPU offload)", (*FULL_70B, *JOB, *EIGHT_A100), 13.9),
    Row("  + activation offload, 32 loss chunks", (*FULL_70B, *JOB, *EIGHT_A100, *OFFLOAD), 13.9),
    Row("recipe llama3_8b_lora", ("recipe=llama3_8b_lora",), recipe="llama3_8b_lora"),
    Row("recipe llama3_8b_qlora", ("recipe=llama3_8b_qlora",), recipe="llama3_8b_qlora"),
    Row("recipe qwen3_8b_lora_fsdp", ("recipe=qwen3_8b_lora_fsdp",), recipe="qwen3_8b_lora_fsdp"),
    Row("recipe llama3_70b_qlora_fsdp", ("recipe=llama3_70b_qlora_fsdp",), recipe="llama3_70b_qlora_fsdp"),
    Row("recipe llama3_8b_lora_dpo", ("recipe=llama3_8b_lora_dpo",), recipe="llama3_8b_lora_dpo"),
)
# Plan lines shown per row: what the fine-tuning terms and the main differences from torchtune cost.
SHOWN = (Line.PARAMETERS, Line.NF4_BASE_WEIGHTS, Line.OPTIMIZER_STATE, Line.ACTIVATIONS, Line.LOSS_BACKWARD_BUFFERS)


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


def overrides_list(rows: list[dict]) -> list[str]:
    """The command that reproduces each row's plan."""
    return [f"- {r['job'].strip()}: `dtlaunch plan {' '.join(r['overrides'])}`" for r in rows]


def table(rows: list[dict]) -> str:
    def lines(r: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in r["lines_gib"].items())

    return markdown_table(
        [
            "job",
            "hardware",
            "torchtune GiB",
            "dtlaunch planned GiB",
            "at or below",
            "device total / capacity",
            "fits",
            "lines (GiB)",
        ],
        [
            [
                r["job"],
                r["hardware"],
                "-" if r["published_gib"] is None else f"{r['published_gib']:.1f}",
                f"{r['planned_reserved_gib']:.1f} reserved ({r['planned_allocated_gib']:.1f} allocated)",
                "-"
                if r["published_gib"] is None
                else "yes"
                if r["planned_allocated_gib"] <= r["published_gib"]
                else "no",
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
            "## The commands",
            "",
            *overrides_list(rows),
            "",
            "## About the comparison",
            "",
            *doc.splitlines()[2:],
            "",
        ]
        Path(args.markdown).write_text("\n".join(head))


if __name__ == "__main__":
    main()
