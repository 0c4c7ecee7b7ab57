"""Predicted vs measured peak on real multi-process CPU runs (`dtlaunch train`, gloo, StorageCounter).

A CI-sized subset of bench/planner_accuracy.py --real (the full matrix and its table live there):
DDP, ZeRO-3 (+ selective AC), tensor parallel (+ sequence parallel), FSDP x TP, a 1F1B pipeline and
context parallel (CP=2 over ZeRO-3), on the 7M-parameter planner model at seq 128. Bounds from the
issue: every run within 8 %, median within 3 %; under PP every stage is held to the 8 %.
"""

import importlib.util
import statistics
from pathlib import Path

import pytest
from cli_server import run_dtlaunch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "planner_accuracy.py"
SUBSET = [
    ["strategy=ddp", "launch.nproc_per_node=2"],
    ["strategy=zero3", "launch.nproc_per_node=2", "training.activation_checkpointing=selective"],
    ["strategy=tp", "launch.nproc_per_node=2"],
    # A 32k vocabulary makes loss_parallel's backward (one fp32 vocabulary shard) the peak.
    ["strategy=tp", "launch.nproc_per_node=2", "model.vocab_size=32000", "precision=bf16"],
    ["strategy=fsdp_tp", "launch.nproc_per_node=4", "precision=bf16"],
    ["strategy=pp", "launch.nproc_per_node=2", "strategy.pp_microbatches=4"],
    [
        "strategy=zero3",
        "strategy.cp=2",
        "launch.nproc_per_node=2",
        "precision=bf16",
        "training.activation_checkpointing=selective",
    ],
]


def _bench():
    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(bench, overrides: list[str], **kw) -> dict:
    # Two steps: the second holds what every later one does (the optimizer's states, allocated by the first).
    kw.setdefault("steps", 2)
    return bench.run_real(overrides, dtlaunch=lambda args, env: run_dtlaunch(args, env=env), **kw)


@pytest.mark.slow
@pytest.mark.slow_reason("seven real 2-4 process runs, one per layout the planner models (DDP to CP): measured peaks")
def test_predicted_peak_matches_real_runs():
    bench = _bench()
    rows = [_run(bench, ov) for ov in SUBSET]
    table = "\n".join(bench._fmt(r) for r in rows)
    assert all(r["measured"] > 0 for r in rows), table
    errs = [abs(bench._err(r)) for r in rows]
    assert max(errs) <= 8.0, table
    stages = [abs(bench._err(s)) for r in rows for s in r["stages"] if len(r["stages"]) > 1]
    assert stages and max(stages) <= 8.0, table
    assert statistics.median(errs) <= 3.0, table


MOE_SUBSET = [
    ["model=planner_moe", "strategy=zero3", "launch.nproc_per_node=2"],
    ["model=planner_moe", "strategy=pp", "launch.nproc_per_node=2", "strategy.pp_microbatches=4"],
    # Tensor parallel inside the experts (dtlaunch.models.moe.tp_plan: each expert's width split).
    ["model=planner_moe", "strategy=tp", "launch.nproc_per_node=2", "model.moe.num_shared_experts=1"],
    # LoRA on the routed experts (peft.target_experts): the merged expert weights and the kept copies.
    ["model=planner_moe", "peft=lora", "peft.targets=[wq,wk,wv,wo]", "peft.target_experts=true", "strategy=zero3"]
    + ["launch.nproc_per_node=2", "strategy.ep=2"],
]


@pytest.mark.slow
def test_predicted_peak_matches_real_moe_runs():
    """The MoE block's saved-activation model (dtlaunch/models/moe/activations.py) on real runs; the
    whole MoE matrix is `python bench/planner_accuracy.py --moe`."""
    bench = _bench()
    rows = [_run(bench, ov) for ov in MOE_SUBSET]
    table = "\n".join(bench._fmt(r) for r in rows)
    assert all(r["measured"] > 0 for r in rows), table
    errs = [abs(bench._err(r)) for r in rows] + [abs(bench._err(s)) for r in rows for s in r["stages"]]
    assert max(errs) <= 8.0 and statistics.median(errs) <= 3.0, table


@pytest.mark.slow
def test_predicted_peak_matches_a_real_deepseek_v3_tensor_parallel_run():
    """DeepSeek-V3's latent attention split by heads (dtlaunch/models/deepseek_v3/activations.py's terms
    under TP + SP: per-head ones divided, the low-rank latents whole); the families table has more rows."""
    bench = _bench()
    row = _run(bench, [*bench.DEEPSEEK_V3, "strategy=tp", "launch.nproc_per_node=2"])
    assert row["measured"] > 0 and row["phase"] == "backward" and abs(bench._err(row)) <= 8.0, bench._fmt(row)


OPTIM_SUBSET = [
    [
        "strategy=zero3",
        "launch.nproc_per_node=2",
        "optim.name=adamw8bit",
        "optim.in_backward=true",
        "training.grad_clip=0",
    ],
    ["peft=lora", "strategy=zero3", "launch.nproc_per_node=2", "precision=bf16", "optim.state_dtype=bf16"],
]


@pytest.mark.slow
def test_predicted_peak_matches_real_optimizer_option_runs():
    """torchao's 8-bit AdamW with the step in backward, and bf16 LoRA adapters with the frozen embedding and
    head as FSDP2 units of their own (dtlaunch/plan/optim_terms.py); the whole matrix is
    `python bench/planner_accuracy.py --optim`."""
    bench = _bench()
    rows = [_run(bench, ov) for ov in OPTIM_SUBSET]
    table = "\n".join(bench._fmt(r) for r in rows)
    assert all(r["measured"] > 0 for r in rows), table
    assert max(abs(bench._err(r)) for r in rows) <= 8.0, table


@pytest.mark.slow
@pytest.mark.slow_reason(
    "three real GRPO runs (FSDP2 with a reference pass, LoRA on FSDP2, ZeRO-3 gathering one unit at a time), each "
    "through both phases: the planner's only check against measured generation peaks in the suite"
)
def test_predicted_peak_matches_real_grpo_runs(tmp_path):
    """objective=grpo, both phases in each measured step: FSDP2 with the reference's no-grad pass (beta > 0),
    LoRA on FSDP2 (the rollout generates with the adapters on, after one gather of the shards) and a
    generation-bound ZeRO-3 run gathering one unit at a time (objective.generation_gather=unit). The whole
    matrix (DDP, FSDP2, bf16, full AC, beta, LoRA, QLoRA, whole / unit) is
    `python bench/planner_accuracy.py --grpo`."""
    bench = _bench()
    base = [*bench.REAL_BASE, *bench.grpo_data(tmp_path)]
    # The generation-bound run at half its completion length (16-token prompts still fill the prompt room;
    # generation stays the peak): a ZeRO-3 unit gather per decode token makes decode steps its cost (52 -> 24 s).
    gather = [*bench.GRPO_RUNS[11], "training.seq_len=64", "objective.max_completion_length=48"]
    assert "objective.generation_gather=unit" in gather
    rows = [_run(bench, run, base=base) for run in (bench.GRPO_RUNS[5], bench.GRPO_RUNS[7], gather)]
    assert rows[2]["phase"] == "generation", bench._fmt(rows[2])
    table = "\n".join(bench._fmt(r) for r in rows)
    assert all(r["measured"] > 0 for r in rows), table
    assert max(abs(bench._err(r)) for r in rows) <= 8.0, table
