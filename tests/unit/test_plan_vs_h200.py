"""The plan against what one H200 measured (bench/results/gpu-2026-12-04-nvidia-h200{,-evening}.json, `bash
bench/gpu/run.sh --part 1` and `--part memory`): each dtlaunch run's torch.cuda.max_memory_allocated beside the
plan of its own command, now. Llama-3.2-1B and Llama-3.1-8B-width (4 layers) jobs on one GPU: eager and
compiled, activation checkpointing of each kind, loss chunks, activation offload with and without AC, the step
in backward, adamw8bit, LoRA, QLoRA, 131,072 tokens full and QLoRA. The first file's runs predate
training.loss_chunks=auto's full pass on a GPU profile (auto chunked them: 8); the evening's take the default.
GRPO with LoRA and generation, and GRPO's full fine-tune, among them."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.memory import plan_memory

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
FILES = {"gpu-2026-12-04-nvidia-h200.json": True, "gpu-2026-12-04-nvidia-h200-evening.json": False}  # chunked
MEASURED = [
    dict(r, chunked=chunked)
    for name, chunked in FILES.items()
    for r in json.loads((RESULTS / name).read_text())["runs"]
    if r.get("side") == "dtlaunch" and r.get("measured_bytes") and not r.get("skipped") and not r.get("error")
]
ROWS = MEASURED
IDS = [f"{r['name']}{'' if r['chunked'] else '-evening'}" for r in ROWS]


def _overrides(row: dict) -> list[str]:
    args = [a for a in shlex.split(row["command"]) if "=" in a and not a.startswith(("DTLAUNCH_", "run.dir="))]
    if not row["chunked"] or any(a.startswith("training.loss_chunks=") for a in args):
        return args
    return [*args, "training.loss_chunks=8"]


def _plan_over_measured(row: dict) -> float:
    job = load_job(_overrides(row))
    return plan_memory(job.cfg, job.layout).peak / row["measured_bytes"]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_plan_within_3_percent_of_the_h200(row: dict) -> None:
    ratio = _plan_over_measured(row)
    assert abs(ratio - 1) <= 0.03, (row["name"], ratio)


def test_every_row_is_here() -> None:
    assert len(ROWS) == 23


def test_the_flash_kernels_buffers_are_a_gpu_profiles_and_ulysses_but_not_rings() -> None:
    """CUDA's flash backward (fp32 dq accumulator, grouped K/V gradients expanded to the query heads) bounds a
    long context's block backward on a GPU profile; the CPU's kernel keeps neither (the CPU suite's runs are
    exact without it), and ring attention's chunks are the CP terms' to count."""
    long = ["model=llama3_8b", "model.n_layers=4", "training.micro_batch=1", "training.seq_len=131072"]
    long += ["training.activation_checkpointing=full", "training.mlp_tiles=16", "training.loss_chunks=8"]
    long += ["training.activation_offload=false"]  # (the default differs between GPU and CPU profiles)

    def peak(*more: str) -> float:
        job = load_job([*long, *more])
        return plan_memory(job.cfg, job.layout).peak

    gpu, cpu = peak("hardware=h200_141gb"), peak("hardware=h200_141gb", "hardware.gpus_per_node=0")
    # 32 KB a token at the 8B width (dq's fp32 accumulator, 4 x 4096, and dk, dv expanded, 2 x 2 x 4096), less
    # the tiled MLP's moment it replaces: more than 16 KB a token.
    assert gpu - cpu > 131072 * 4 * 4096
    cp = ["hardware=h100_80gb", "launch.nproc_per_node=2", "strategy=zero3", "strategy.cp=2"]
    ring, ulysses = peak(*cp), peak(*cp, "strategy.cp_style=ulysses")
    ring_cpu = peak(*cp, "hardware.gpus_per_node=0")
    uly_cpu = peak(*cp, "strategy.cp_style=ulysses", "hardware.gpus_per_node=0")
    assert ring == ring_cpu and ulysses > uly_cpu
