"""Every measured correction of the planner (a named constant in dtlaunch/plan/) is tied to a test that
measures it: the comment above the constant names the test, the test exists, and undoing the correction
moves the planned peak of a layout that test runs, so its bound against the measurement sees the term.
Corrections that no test measures say so in their comment and are listed here (the report's gap list)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan import backward, generation, hardware, loss_terms, offload, optim_terms, peft, shape, stage
from dtlaunch.plan.memory import plan_memory

ROOT = Path(__file__).resolve().parents[2]
TRACE = "tests/unit/test_plan_trace.py::test_analytic_within_5_percent_of_trace"
PEFT_TRACE = "tests/unit/test_plan_peft.py::test_head_unit_plan_within_5_percent_of_trace"
REAL_OPTIM = "tests/distributed/test_plan_accuracy.py::test_predicted_peak_matches_real_optimizer_option_runs"
REAL_GRPO = "tests/distributed/test_plan_accuracy.py::test_predicted_peak_matches_real_grpo_runs"
# The layouts of those tests (their own lists: test_plan_trace.BASE, test_plan_peft's and the accuracy
# bench's REAL_BASE).
# The chunked loss named: its logits (a 2k vocabulary, 256-512 tokens) are below the auto threshold.
SMALL = ["model=planner7m", "training.micro_batch=2", "training.seq_len=128", "hardware=cpu", "training.loss_chunks=8"]
REAL = ["model=planner7m", "training.micro_batch=4", "training.seq_len=128", "hardware=cpu", "training.loss_chunks=8"]
LORA_Z3 = [*REAL, "peft=lora", "strategy=zero3", "precision=bf16", "launch.nproc_per_node=2"]

# (module, constant, its value with the correction undone, the test that measures it, a layout it runs)
MEASURED = [
    (
        shape,
        "FSDP_SP_SELECTIVE_HIDDEN_STATES",
        0,
        TRACE,
        [*SMALL, "strategy=fsdp_tp", "launch.nproc_per_node=4", "precision=bf16"]
        + ["training.activation_checkpointing=selective", "training.micro_batch=4"],
    ),
    (
        shape,
        "TP_SP_SELECTIVE_GATHERED_HIDDEN_STATES",
        0,
        "tests/distributed/test_gated_deltanet_tp_activations.py::test_tensor_parallel_ranks_keep_what_the_plan_counts",
        ["model=planner7m", "training.micro_batch=8", "training.seq_len=512", "hardware=cpu", "strategy=tp"]
        + ["launch.nproc_per_node=2", "training.activation_checkpointing=selective"],
    ),
    (
        shape,
        "LORA_SELECTIVE_COUNTED_WITHOUT_SP",
        False,
        TRACE,
        [*SMALL, "strategy=tp", "launch.nproc_per_node=2", "precision=bf16", "peft=lora"]
        + ["training.activation_checkpointing=selective"],
    ),
    (
        backward,
        "HEAD_REDUCE_INPUTS_KEPT",
        0,
        TRACE,
        [*SMALL, "strategy=zero3", "launch.nproc_per_node=8", "precision=bf16"],
    ),
    (
        loss_terms,
        "HEAD_GRAD_SUM_COPIES",
        1,
        TRACE,
        [*SMALL, "strategy=pp", "launch.nproc_per_node=2", "strategy.pp_microbatches=2"],
    ),
    (backward, "LORA_ZERO3_PREFETCHED_BLOCKS", 0, PEFT_TRACE, LORA_Z3),
    (
        loss_terms,
        "HEAD_UNIT_GATHERED_COPIES",
        1,
        PEFT_TRACE,
        [*REAL, "peft=lora", "strategy=zero2", "launch.nproc_per_node=2"],
    ),
    (
        peft,
        "NF4_DEQUANT_CODE_BYTES",
        0,
        PEFT_TRACE,
        [*REAL, "peft=qlora", "peft.nf4_scaler_block_size=128", "strategy=zero3", "launch.nproc_per_node=2"],
    ),
    (
        peft,
        "NF4_DEQUANT_COMPUTE_COPIES",
        0,
        PEFT_TRACE,
        [*REAL, "peft=qlora", "peft.nf4_scaler_block_size=128", "strategy=zero3", "launch.nproc_per_node=2"],
    ),
    (
        optim_terms,
        "EAGER_TEMP",
        4,
        REAL_OPTIM,
        [*REAL, "strategy=zero3", "launch.nproc_per_node=2", "optim.name=adamw8bit", "optim.in_backward=true"]
        + ["training.grad_clip=0"],
    ),
    (
        generation,
        "UNIT_GATHER_COPIES",
        0,
        REAL_GRPO,
        ["model=planner7m", "hardware=cpu", "objective=grpo", "objective.num_generations=8", "training.seq_len=128"]
        + ["objective.max_completion_length=112", "training.micro_batch=8", "training.global_batch=128"]
        + ["strategy=zero3", "launch.nproc_per_node=2", "training.activation_checkpointing=full"]
        + ["objective.generation_gather=unit"],
    ),
]
# Fitted to measurements that no test repeats (their comments say where they were measured).
UNMEASURED = [
    (hardware, "GLOO_EXTRA_BUFFER_COPIES"),
    (stage, "FROZEN_EMBEDDING_GATHER_COPIES"),
    (offload, "RELOADED_F_WIDE_TENSORS"),
]
# Modules that import a constant by name, which must be undone there too.
IMPORTED_INTO = {"GLOO_EXTRA_BUFFER_COPIES": (stage, backward)}


def _comment_above(module, name: str) -> str:
    """The comment block right above `NAME = ...` in the module's source."""
    lines = Path(module.__file__).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} = "))
    block = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        block.append(line)
    return "\n".join(reversed(block))


def _test_exists(test_id: str) -> bool:
    path, func = test_id.split("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == func for node in tree.body)


@pytest.mark.parametrize("module,name,undone,test_id,overrides", MEASURED, ids=[m[1] for m in MEASURED])
def test_each_correction_names_a_test_that_sees_it(module, name, undone, test_id, overrides, monkeypatch):
    assert f"Measured by {test_id}" in _comment_above(module, name), name
    assert _test_exists(test_id), test_id
    job = load_job(overrides)
    before = {s.stage: s.peak for s in plan_memory(job.cfg, job.layout).stages}
    for where in (module, *IMPORTED_INTO.get(name, ())):
        monkeypatch.setattr(where, name, undone)
    after = {s.stage: s.peak for s in plan_memory(job.cfg, job.layout).stages}
    moved = max(abs(after[k] - before[k]) / before[k] for k in before)
    assert moved >= 0.005, (name, before, after)  # the test's bound sees the term at this layout


@pytest.mark.parametrize("module,name", UNMEASURED, ids=[m[1] for m in UNMEASURED])
def test_unmeasured_corrections_say_so(module, name):
    assert "Not measured by a test" in _comment_above(module, name), name


def test_every_named_correction_is_listed():
    """A new `Measured by` / `Not measured by` constant in dtlaunch/plan/ joins one of the lists above."""
    listed = {name for _, name, *_ in MEASURED} | {name for _, name in UNMEASURED}
    found = set()
    for path in (ROOT / "dtlaunch" / "plan").glob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r"^# (?:Measured by|Not measured by)[^\n]*\n(?:#[^\n]*\n)*([A-Z0-9_]+) = ", text, re.M))
    assert found == listed
