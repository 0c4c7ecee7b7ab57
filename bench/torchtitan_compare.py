"""dtlaunch's memory plan for torchtitan's published Llama-3.1 runs, next to the peaks torchtitan measured.

Source of the measured figures: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md
(Grand Teton H100 96 GB HBM2e, torch/torchtitan of 2024-12; "Memory(GiB)" is torchtitan's
`max_reserved_gib`: the caching allocator's peak *reserved* bytes, which excludes the CUDA context and
NCCL's own buffers). Each row restates the table's job as dtlaunch overrides (same model, parallel
degrees, local batch, sequence length 8192 (torchtitan's Llama-3 default), activation checkpointing and
compile); dtlaunch's comparable figure is its planned peak allocated bytes plus the allocator's
fragmentation share of the hardware profile (`hardware.fragmentation`), i.e. planned reserved memory.

Pipeline rows: torchtitan (at the benchmarked commit) splits the local batch into as many
micro-batches as there are pipeline stages unless told otherwise: 8 for 1F1B (one stage per rank), 16
for interleaved 1F1B (two per rank), so each micro-batch is 4 (2) sequences of the local 32.

What cannot be restated: AsyncTP (a communication overlap, not modelled), torchtitan's selective AC in
the 70B/405B rows (they use full AC, as here).

    python bench/torchtitan_compare.py [--json out.json] [--markdown bench/results/torchtitan-compare.md]
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
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
BASE = ["precision=bf16", "hardware=h100_94gb", "data=synthetic", "training.seq_len=8192", "launch.nproc_per_node=8"]
# torchtitan's loss at the benchmarked commit: one full-vocabulary cross-entropy (loss_parallel under TP).
LIKE_FOR_LIKE = "training.loss_chunks=1"
SAC, FULL, COMPILE = (
    "training.activation_checkpointing=selective",
    "training.activation_checkpointing=full",
    "training.compile=true",
)
F8 = "precision.float8=tensorwise"


@dataclass(frozen=True)
class Row:
    table: str
    job: str
    published_gib: float
    overrides: tuple[str, ...]
    note: str = ""


def _8b(nodes: int, *extra: str) -> tuple[str, ...]:
    gb = 2 * 8 * nodes
    return (
        "model=llama3_8b",
        "strategy=fsdp",
        "cluster=slurm",
        f"cluster.nodes={nodes}",
        "cluster.gpus_per_node=8",
        "training.micro_batch=2",
        f"training.global_batch={gb}",
        SAC,
        *extra,
    )


_70B = (
    "model=llama3_70b",
    "strategy=fsdp_tp",
    "strategy.tp=8",
    "cluster=slurm",
    "cluster.nodes=32",
    "cluster.gpus_per_node=8",
    "training.micro_batch=16",
    "training.global_batch=512",
    FULL,
    COMPILE,
)
_405B = (
    "model=llama3_405b",
    "strategy=3d",
    "strategy.tp=8",
    "strategy.pp=8",
    "cluster=slurm",
    "cluster.nodes=64",
    "cluster.gpus_per_node=8",
    "training.global_batch=256",
    FULL,
    COMPILE,
)
ROWS = (
    Row("1", "8B FSDP 8, op-SAC", 82.4, _8b(1)),
    Row("1", "8B FSDP 8, op-SAC, compile", 77.0, _8b(1, COMPILE)),
    Row("1", "8B FSDP 8, op-SAC, compile, float8", 76.8, _8b(1, COMPILE, F8)),
    Row("3", "8B FSDP 128, op-SAC", 67.0, _8b(16)),
    Row("3", "8B FSDP 128, op-SAC, compile", 62.0, _8b(16, COMPILE)),
    Row("3", "8B FSDP 128, op-SAC, compile, float8", 61.8, _8b(16, COMPILE, F8)),
    Row("4", "70B FSDP 32 x TP 8, full AC, compile, float8", 71.9, (*_70B, F8)),
    Row(
        "5",
        "405B FSDP 8 x TP 8 x PP 8, 1F1B, full AC, compile, float8",
        82.5,
        (*_405B, "training.micro_batch=32", "strategy.pp_microbatches=8", "strategy.pp_schedule=1f1b", F8),
        "torchtitan also AsyncTP",
    ),
    Row(
        "5",
        "405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B, full AC, compile, float8",
        72.7,
        (
            *_405B,
            "training.micro_batch=32",
            "strategy.pp_microbatches=16",
            "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pp_stages_per_rank=2",
            F8,
        ),
        "torchtitan also AsyncTP",
    ),
)


def plan_row(row: Row) -> dict:
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    job = load_job([*BASE, *row.overrides, LIKE_FOR_LIKE])
    plan = plan_memory(job.cfg, job.layout)
    frag = float(job.cfg.hardware.fragmentation)
    reserved = plan.peak * (1 + frag)
    # dtlaunch's own default on the same job: the chunked loss (training.loss_chunks=8).
    own = load_job([*BASE, *row.overrides])
    own_reserved = plan_memory(own.cfg, own.layout).peak * (1 + frag)
    return {
        "table": row.table,
        "job": row.job,
        "published_gib": row.published_gib,
        "planned_allocated_gib": plan.peak / GIB,
        "planned_reserved_gib": reserved / GIB,
        "planned_device_total_gib": plan.device_total / GIB,
        "default_reserved_gib": own_reserved / GIB,
        "ratio": reserved / GIB / row.published_gib,
        "at_or_below": reserved / GIB <= row.published_gib,
        "peak_phase": plan.worst.phase,
        "peak_stage": plan.worst.stage,
        "overrides": list(row.overrides),
        "note": row.note,
    }


def table(rows: list[dict]) -> str:
    return markdown_table(
        [
            "torchtitan table",
            "job",
            "published max reserved GiB",
            "dtlaunch planned reserved GiB",
            "ratio",
            "dtlaunch default (chunked loss) GiB",
            "at or below",
            "note",
        ],
        [
            [
                r["table"],
                r["job"],
                f"{r['published_gib']:.1f}",
                f"{r['planned_reserved_gib']:.1f} ({r['planned_allocated_gib']:.1f} allocated)",
                f"{r['ratio']:.3f}",
                f"{r['default_reserved_gib']:.1f}",
                "yes" if r["at_or_below"] else "no",
                r["note"],
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
        head = [
            "# dtlaunch plan vs torchtitan's published peak memory (Llama-3.1, H100 96 GB)",
            "",
            f"Published figures: {SOURCE} (torchtitan's max reserved memory).",
            "dtlaunch: planned peak allocated x (1 + hardware.fragmentation) on hardware=h100_94gb, with",
            "torchtitan's full-vocabulary loss (`training.loss_chunks=1`); the default column is the same job",
            "with dtlaunch's default chunked loss. Term by term: `torchtitan-reconcile-2026-11-26.md`.",
            "Reproduce: `python bench/torchtitan_compare.py`.",
            "",
        ]
        Path(args.markdown).write_text("\n".join(head) + text + "\n")


if __name__ == "__main__":
    main()
