"""GPU benchmark (one H100/H200, two parts of ~8 minutes): on layouts that fit one GPU, the planner's
prediction against what the GPU measured, and dtlaunch's throughput against the hand-written loop.

- Llama-3.2-1B shape (1.5B parameters), eager and compiled: `dtlaunch train` vs bench/handwritten.py on
  the same job (tokens/s, MFU).
- Truncated Llama-3.1-8B (4 layers) and -70B (2 layers) shapes (real widths, so a block's activations and
  weights are the real ones): activation checkpointing none / op-SAC / layer-SAC / full and compile's
  memory budget, compile off/on, float8 (tensorwise, rowwise; torchao).
- The largest model the planner says fits, with full AC.
- `--part memory` (< 8 minutes, its own default budget): each memory feature on one GPU against its plan,
  on the 8B width with 4 layers and the real 128k vocabulary at 2 x 2048 tokens: baseline
  (training.loss_chunks=1), loss_chunks=8, full AC, activation offload and optim.in_backward (both under
  full AC), adamw8bit, LoRA (frozen embedding/head in the compute dtype), LoRA with optim.state_dtype=bf16,
  QLoRA, CPU offload (2+ GPUs only: validation refuses it on one rank, and the row says so). Per row:
  planned peak and device total, measured max_memory_allocated and max_memory_reserved, the plan's error,
  tokens/s against the baseline and against the feature's reference row. A row whose option this
  checkout lacks is skipped with the reason.

Every dtlaunch run compares the plan (plan.json: the figure `dtlaunch plan --json` prints) with the
worker's torch.cuda.max_memory_allocated (summary.json), and the plan's device total (peak + CUDA
context and allocator overheads) with the peak of nvidia-smi's memory.used during the run.
All bf16, micro-batch 4 x 2048 tokens per GPU, FSDP2 strategy (a world of one trains unwrapped).

    bash bench/gpu/run.sh --part memory                 # or: make bench-gpu-memory (budget 400 s built in)
    bash bench/gpu/run.sh --part 1 --budget-s 480       # or: make bench-gpu (all parts, no budget)
    bash bench/gpu/run.sh --part 2 --budget-s 480
    python bench/gpu/gpu_bench.py --merge bench/results/gpu-<date>-<device>-part{1,2}.json
    python bench/gpu/gpu_bench.py --dry-run             # CPU: compose and plan every run
    python bench/gpu/gpu_bench.py --rehearse            # CPU: every run end to end, tiny shapes (see below)

Results: bench/results/gpu-<date>-<device>[-partN|-memory].md and .json (--results-dir elsewhere), rewritten after
every run, so a run cut short keeps what it measured. With --budget-s the bench starts no run it cannot
finish inside the budget and stops one that overruns; what it left out is listed as skipped.

--rehearse runs the same code on CPU: every run of the list, shrunk (dim 64, 2 layers, vocab 512,
micro-batch 2 x 64 tokens, 6 steps), through the same measurement, hand-written comparison, plan
check and results writer, into a temporary directory. Left out there, because they need CUDA: float8
runs (torchao's float8 matmuls; the rehearsal only checks that torchao's float8 API resolves, when it
is installed) and the nvidia-smi memory watch; compiled runs are left out unless --rehearse-compile
(inductor on CPU takes minutes per run). Never run by CI except the rehearsal's unit test.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import throughput  # noqa: E402
from bench.common import BENCH, ROOT, describe_machine, markdown_table, write_json  # noqa: E402

# Llama-3.2-1B's shape (untied output head: 1.50B parameters, 1.24B of them in matmuls).
LLAMA_1B = (
    "model=llama3_8b",
    "model.name=llama_1b",
    "model.dim=2048",
    "model.n_layers=16",
    "model.n_heads=32",
    "model.n_kv_heads=8",
)
LLAMA_3B = ("model=llama3_8b", "model.name=llama_3b", "model.dim=3072", "model.n_layers=28", "model.n_heads=24")
# Real widths, truncated depth: the per-layer activations and weights of the big models on one device.
LLAMA_8B_4L = ("model=llama3_8b", "model.name=llama3_8b_4l", "model.n_layers=4")
LLAMA_70B_2L = ("model=llama3_70b", "model.name=llama3_70b_2l", "model.n_layers=2")
# Candidates for "the largest that fits", biggest first; the planner picks.
LARGER = (("llama3_8b", ("model=llama3_8b",)), ("llama_3b", LLAMA_3B))

SEL = "training.activation_checkpointing=selective"
VARIANTS: dict[str, tuple[str, ...]] = {
    "ac-none": (),
    "ac-op": (SEL, "training.ac_policy=op"),
    "ac-layer": (SEL, "training.ac_policy=layer", "training.ac_every_n_layers=2"),
    "ac-full": ("training.activation_checkpointing=full",),
    "budget-0.5": (SEL, "training.ac_memory_budget=0.5"),  # compile only (validated)
    "float8-tensorwise": ("precision.float8=tensorwise",),
    "float8-rowwise": ("precision.float8=rowwise",),
}
BOTH = ("dtlaunch", "handwritten")
# A run is not started with less than this left of --budget-s (its timeout would cut it short anyway).
MIN_START_S = {False: 45.0, True: 90.0}  # eager, compiled

# Tiny shapes for --rehearse: the same overrides, these keys replaced (later keys win in `shrink`).
REHEARSAL_SHAPE = (
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=512",
    "model.multiple_of=32",
    "training.micro_batch=2",
    "training.seq_len=64",
    "training.log_every=2",
    "optim.warmup_steps=2",
)


@dataclass(frozen=True)
class Run:
    """One row of the benchmark: a model family, eager or compiled, one AC/precision variant."""

    family: str  # "1b", "8b-4l", ...
    compile: bool
    variant: str  # a VARIANTS key
    overrides: tuple[str, ...]
    sides: tuple[str, ...] = ("dtlaunch",)
    part: int | str = 1  # 1, 2 or "memory"

    @property
    def name(self) -> str:
        return f"{self.family}-{'compile' if self.compile else 'eager'}-{self.variant}"


def job(model: Sequence[str], nproc: int, hw: str, steps: int, extra: Sequence[str]) -> tuple[str, ...]:
    return (
        *model,
        "strategy=fsdp",
        "precision=bf16",
        f"hardware={hw}",
        f"launch.nproc_per_node={nproc}",
        "training.micro_batch=4",
        "training.seq_len=2048",
        f"training.steps={steps}",
        "training.log_every=10",  # one host sync per 10 steps in the logger, on both sides
        "optim.warmup_steps=5",
        "checkpoint=none",
        "data=synthetic",
        "training.loss_plot=false",  # matplotlib at the end of every run: seconds of GPU time for nothing
        *extra,
    )


def run_list(nproc: int, hw: str, steps: int, fits: Callable[[tuple[str, ...]], bool]) -> list[Run | LargestFitting]:
    """Every run, most important first within each part (a part cut short by its budget loses its tail).
    Part 1: the dtlaunch / hand-written comparison and the AC trade-off on the 8B width; part 2: compile's
    memory budget, float8, the 70B width and the largest model that fits. `fits(overrides)` is asked only
    for the largest-model candidates, lazily (see `selected`)."""

    def run(family: str, model: Sequence[str], compiled: bool, variant: str, part: int, sides=("dtlaunch",)) -> Run:
        extra = [*VARIANTS[variant], *(["training.compile=true"] if compiled else [])]
        return Run(family, compiled, variant, job(model, nproc, hw, steps, extra), tuple(sides), part)

    runs: list[Run | LargestFitting] = [
        run("1b", LLAMA_1B, False, "ac-none", 1, BOTH),
        run("8b-4l", LLAMA_8B_4L, False, "ac-none", 1),
        run("8b-4l", LLAMA_8B_4L, False, "ac-op", 1),
        run("8b-4l", LLAMA_8B_4L, False, "ac-full", 1),
        run("8b-4l", LLAMA_8B_4L, False, "ac-layer", 1),
        run("1b", LLAMA_1B, True, "ac-none", 1, BOTH),
        run("8b-4l", LLAMA_8B_4L, True, "ac-none", 1),
        run("8b-4l", LLAMA_8B_4L, True, "ac-op", 1),
        run("8b-4l", LLAMA_8B_4L, True, "ac-full", 1),
        run("8b-4l", LLAMA_8B_4L, True, "budget-0.5", 2),
        run("8b-4l", LLAMA_8B_4L, True, "float8-tensorwise", 2),
        run("8b-4l", LLAMA_8B_4L, True, "float8-rowwise", 2),
        run("70b-2l", LLAMA_70B_2L, False, "ac-none", 2),
        run("70b-2l", LLAMA_70B_2L, False, "ac-op", 2),
        run("70b-2l", LLAMA_70B_2L, False, "ac-full", 2),
        run("70b-2l", LLAMA_70B_2L, True, "ac-op", 2),
    ]
    runs.append(LargestFitting(nproc, hw, steps, fits))  # resolved by `selected`
    runs += [
        run("70b-2l", LLAMA_70B_2L, True, "ac-none", 2),
        run("70b-2l", LLAMA_70B_2L, True, "ac-full", 2),
    ]
    return runs


# The memory part (--part memory): each memory feature on ONE GPU against its plan, on a shape where
# each matters: the 8B width with 4 layers and the real 128k vocabulary (the logits of 2 x 2048 tokens are
# 1 GiB in bf16, 2 GiB in fp32), bf16, one rank (FSDP2's world of one trains unwrapped). Every row is
# a reference row plus one feature (`MEMORY_FEATURES`), so each feature reads against the same job without it.
MEMORY = "memory"
MEM_STEPS, MEM_WARMUP = 12, 4  # steps per run, steps excluded from tokens/s
# Default --budget-s of the memory part: counted from the bench's own start; a run still going at it is
# stopped (SIGTERM, SIGKILL 45 s later), so the command ends within ~7.5 minutes.
MEM_BUDGET_S = 400.0
MEM_RUN_TIMEOUT_S = 120.0  # default --run-timeout of the memory part (a run takes ~20-45 s on an H100)
FULL_AC = "training.activation_checkpointing=full"
LORA = "peft=lora"
# The long-context rows: one sequence at the longest seq_len the plan fits on this GPU (`plan --maximize
# training.seq_len`, evaluated when the rows are built, for this hardware profile and host RAM), with every
# saver maximize leans on: full AC, activation offload (set explicitly, whatever its default), chunked loss
# and the tiled MLP the plan picks. The search stops at the model's own context (131,072 for Llama 3.1):
# past it, 4 layers at the GPU's limit (~320k tokens full fine-tune) take ~50 s a step on an H100, too slow
# for this part's budget. At 131,072 tokens a step is ~27 GFLOP/token x 131k ~ 3.6 PFLOP, ~10 s on an H100:
# LONG_STEPS steps plus start-up ~ 55 s a row, tokens/s over the last LONG_STEPS // 2.
LONG_STEPS = 4
LONGCTX = (
    FULL_AC,
    "training.activation_offload=true",
    "training.loss_chunks=8",
    "training.micro_batch=1",
    f"training.steps={LONG_STEPS}",
)
# objective=grpo (issue 39): LoRA (GRPO on one GPU, as users run it) with 8 prompts x 8 completions on the
# rank, generated at once (a 64-row KV cache, the prefill's 128k-wide logits), up to 256 tokens after a
# 256-token prompt room, on synthetic prompts, trained in micro-batches of 8 under full AC with the head in
# chunks: the plan's peak is the generation phase. The compiled row decodes under CUDA graphs
# (objective.generation_compile) against the eager one (generated tokens/s in the JSON). The training phase
# against its plan: the `grpo-train` row (full fine-tune, one group per step: backward the peak).
# GRPO_STEPS steps, tokens/s over the last one. The prompts (`grpo_prompts`) fill the prompt room, as the
# plan assumes: word-level prompts of one token per word, which need the `tokenizers` package.
GRPO_STEPS = 3
GRPO = (
    "objective=grpo",
    "objective.num_generations=8",
    "objective.max_completion_length=256",
    "training.seq_len=512",
    "training.micro_batch=8",
    "training.loss_chunks=8",
    f"training.steps={GRPO_STEPS}",
)
GRPO_PROMPT_ROOM = 256


def grpo_prompts(words: int) -> tuple[str, ...]:
    """Data overrides reading 32 prompts of `words` one-token words (bench/planner_accuracy.grpo_data), in
    a directory of the machine's temp dir; () without the `tokenizers` package (the rows are then skipped)."""
    import importlib.util

    from bench.planner_accuracy import grpo_data

    if importlib.util.find_spec("tokenizers") is None:
        return ()
    root = Path(tempfile.gettempdir()) / "dtlaunch-gpu-grpo-prompts"
    root.mkdir(exist_ok=True)
    return tuple(grpo_data(root, words))


GRPO_GENERATION = (*GRPO, LORA, FULL_AC, "training.global_batch=64")
# (variant, overrides on top of the baseline, data-parallel ranks, reference row), most important first:
# a budget cut loses the tail. A feature reads against its reference row (the same job without it); the
# baseline's training.loss_chunks=1 is added by `memory_runs` where the schema has it. in_backward runs
# under full AC: without it the peak is the loss's backward, before any gradient exists, and the plan
# gives in_backward nothing to save there.
MEMORY_FEATURES: tuple[tuple[str, tuple[str, ...], int, str], ...] = (
    ("baseline", (), 1, ""),
    ("loss-chunks-8", ("training.loss_chunks=8",), 1, "baseline"),
    ("ac-full", (FULL_AC,), 1, "baseline"),
    ("act-offload", (FULL_AC, "training.activation_offload=true"), 1, "ac-full"),
    # The plan's longest context (issue 41): seq_len is maximized at bench time (`memory_runs`).
    ("longctx-full", LONGCTX, 1, ""),
    ("grpo", GRPO_GENERATION, 1, ""),
    ("grpo-compiled", (*GRPO_GENERATION, "objective.generation_compile=true"), 1, "grpo"),
    ("adamw8bit", ("optim.name=adamw8bit",), 1, "baseline"),
    ("in-backward", (FULL_AC, "optim.in_backward=true", "training.grad_clip=0"), 1, "ac-full"),
    ("lora", (LORA,), 1, "baseline"),  # frozen base; frozen embedding and head in the compute dtype
    ("lora-bf16-state", (LORA, "optim.state_dtype=bf16"), 1, "lora"),  # validation: bf16 state under PEFT only
    ("qlora", (LORA, "peft.method=qlora"), 1, "lora"),
    ("longctx-qlora", (*LONGCTX, LORA, "peft.method=qlora"), 1, ""),
    ("grpo-train", (*GRPO, "training.global_batch=8"), 1, ""),
    # Under full AC only 4 small block inputs move; without AC every block's saved activations do.
    ("act-offload-no-ac", ("training.activation_offload=true",), 1, "baseline"),
    # FSDP over one rank only to keep parameters, gradients and AdamW state on the host (ZeRO-Offload).
    ("cpu-offload", ("strategy.cpu_offload=true",), 1, "baseline"),
)
MEMORY_REFERENCE = {variant: ref for variant, _, _, ref in MEMORY_FEATURES}


def mem_job(nproc: int, hw: str, steps: int, extra: Sequence[str], host_gib: float = 0.0) -> tuple[str, ...]:
    return (
        *LLAMA_8B_4L,
        "strategy=fsdp",
        "precision=bf16",
        f"hardware={hw}",
        f"launch.nproc_per_node={nproc}",
        "training.micro_batch=2",
        "training.seq_len=2048",
        f"training.steps={steps}",
        "training.log_every=2",  # a metrics line at step MEM_WARMUP (the steady window's start)
        "training.sync_interval_s=0",  # ... which a widened logging window would skip
        "optim.warmup_steps=2",
        "checkpoint=none",
        "data=synthetic",
        "training.loss_plot=false",
        # The plan checks activation / CPU offload's host bytes against this machine's RAM.
        *([f"hardware.host_memory_gib={host_gib}"] if host_gib else []),
        *extra,
    )


def schema_has(key: str) -> bool:
    """Whether this checkout's config schema has `key` ('training.loss_chunks')."""
    from dataclasses import fields, is_dataclass

    from dtlaunch.config.schema import JobConfig

    node: Any = JobConfig()
    for part in key.split("."):
        if not is_dataclass(node) or part not in {f.name for f in fields(node)}:
            return False
        node = getattr(node, part)
    return True


def memory_runs(hw: str, steps: int, host_gib: float = 0.0, gpus: int = 1) -> list[Run]:
    """The memory part's rows. Rows whose data-parallel ranks this machine lacks run on one rank anyway,
    so that validation names why they cannot (`memory_skip_reason`)."""
    base = ("training.loss_chunks=1",) if schema_has("training.loss_chunks") else ()
    out = []
    for variant, extra, ranks, _ in MEMORY_FEATURES:
        nproc = ranks if ranks <= gpus else 1
        keys = {e.split("=", 1)[0] for e in extra}
        # `shrink` replaces the job's keys that a row sets (training.steps, micro_batch) instead of repeating them.
        overrides = shrink(
            mem_job(nproc, hw, steps, [b for b in base if b.split("=", 1)[0] not in keys], host_gib), extra
        )
        if variant.startswith("longctx"):
            overrides = longest_context(overrides)
        if "objective=grpo" in overrides:
            overrides = shrink(overrides, grpo_prompts(GRPO_PROMPT_ROOM))
        out.append(Run("mem-8b-4l", False, variant, overrides, ("dtlaunch",), MEMORY))
    return out


@functools.cache
def longest_context(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """`overrides` at the longest training.seq_len the plan fits, with the savers the plan chose there (the
    tiled MLP) spelled out. A job that does not validate is left as it is (`memory_skip_reason` skips it
    with validation's reason); when nothing fits, the row asks for the model's longest context, so that the
    launch's plan gate refuses it with the plan's figures instead of the row running a short sequence."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.maximize import SAVERS, maximize

    try:
        cfg = load_job(list(overrides)).cfg
    except Exception:  # composition and validation errors alike: memory_skip_reason reports them
        return overrides
    # The row's savers are the ones it measures (LONGCTX): the search turns on none of its own.
    best = maximize(cfg, "training.seq_len", pinned={s.key for s in SAVERS})
    if best.value is None:
        return shrink(overrides, (f"training.seq_len={best.largest}",))
    return shrink(overrides, (best.override, *best.savers))


def seq_len(run: Run) -> int:
    """The training.seq_len `run` sets (the last one wins, as in composition)."""
    return [int(o.split("=", 1)[1]) for o in run.overrides if o.startswith("training.seq_len=")][-1]


def steps_of(run: Run, default: int) -> int:
    """The training.steps a row sets for itself, else `default`."""
    return next((int(o.split("=", 1)[1]) for o in run.overrides if o.startswith("training.steps=")), default)


def memory_skip_reason(run: Run) -> str:
    """'' when the row composes and validates here, else why not: a field this checkout's schema lacks
    (a feature not merged yet), a missing package, or a layout validation refuses. The same checks `dtlaunch train` runs first, done here so the row is skipped with the reason."""
    from dtlaunch.commands.common import load_job

    if "objective=grpo" in run.overrides and not any(o.startswith("data.path=") for o in run.overrides):
        return "objective=grpo's prompt data needs the tokenizers package (bash bench/gpu/wheels.sh carries it)"
    for o in run.overrides:
        key = o.split("=", 1)[0]
        if "." in key and not schema_has(key):
            return f"{key} is not in this checkout's config schema"
    try:
        load_job(list(run.overrides))
    except Exception as e:  # ConfigError and composition errors alike: the message is the reason
        return f"refused by validation: {str(e).strip().splitlines()[0][:240]}"
    return ""


@dataclass
class LargestFitting:
    """Placeholder for "the largest candidate the planner says fits, with full AC": the planner is asked
    only when the run is selected, so `--only`/`--part` runs never pay for it."""

    nproc: int
    hw: str
    steps: int
    fits: Callable[[tuple[str, ...]], bool] = field(repr=False)
    name: str = "largest-fitting"
    part: int = 2

    def resolve(self) -> Optional[Run]:
        for tag, model in LARGER:
            overrides = job(model, self.nproc, self.hw, self.steps, VARIANTS["ac-full"])
            if self.fits(overrides):
                return Run(f"largest-{tag}", False, "ac-full", overrides, ("dtlaunch",), self.part)
        return None


def selected(runs: Sequence[Run | LargestFitting], only: set[str], part: int | str) -> list[Run]:
    """The runs `--only` (names, or 'largest-fitting') and `--part` keep, placeholders resolved."""
    out = []
    for r in runs:
        if (part and r.part != part) or (only and r.name not in only):
            continue
        if isinstance(r, LargestFitting):
            r = r.resolve()
            if r is None:
                continue
        out.append(r)
    return out


def shrink(overrides: Sequence[str], extra: Sequence[str] = REHEARSAL_SHAPE) -> tuple[str, ...]:
    """`overrides` with the keys of `extra` replaced (or added): the same job at a tiny shape."""
    keys = {e.split("=", 1)[0] for e in extra}
    return (*(o for o in overrides if o.split("=", 1)[0] not in keys), *extra)


def rehearsal_overrides(run: Run) -> tuple[str, ...]:
    """`run`'s overrides at the rehearsal's tiny shape; QLoRA's NF4 scaler blocks shrunk to whole blocks of
    its 64-wide weights (64 x 16 elements); objective=grpo's completions shortened to fit its sequence."""
    extra = ("peft.nf4_scaler_block_size=16",) if "peft.method=qlora" in run.overrides else ()
    # objective=grpo: a 64-position sequence (48 for the prompts, 16 generated), the words' 2,002 ids
    if "objective=grpo" in run.overrides:
        extra += ("objective.max_completion_length=16", "model.vocab_size=2048", *grpo_prompts(48))
    return shrink(run.overrides, (*REHEARSAL_SHAPE, *extra))


def hardware_option(gpu_name: str) -> str:
    """The configs/hardware option for the detected GPU (peak TFLOP/s for MFU, capacity for the plan)."""
    name = gpu_name.lower()
    if "h200" in name:
        return "h200_141gb"
    if "h100" in name:
        return "h100_94gb" if "nvl" in name or "94" in name else "h100_80gb"
    if "a100" in name:
        return "a100_80gb" if "80" in name else "a100_40gb"
    return "h100_80gb"


def console(name: str, module: str) -> list[str]:
    """A console script next to this interpreter or on PATH, else `python -m module`: on a GPU machine
    dtlaunch may run from the checkout (PYTHONPATH, see run.sh) with no `dtlaunch` script installed."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return [str(here)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


# The GPU, asked in a child process: the bench's own process must not hold a CUDA context (hundreds of
# MiB of the device) while the runs it measures are on it.
_DEVICE_INFO = """
import importlib.util, json
import torch
from bench.common import machine_info
info = machine_info()
info["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    info["gpu_memory_bytes"] = int(p.total_memory)
info["torchao"] = None
if importlib.util.find_spec("torchao") is not None:
    import torchao
    info["torchao"] = getattr(torchao, "__version__", "?")
print("DEVICE_INFO " + json.dumps(info))
"""


def device_info() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_INFO], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("DEVICE_INFO "):
            return json.loads(line[len("DEVICE_INFO ") :])
    raise SystemExit(f"could not read the machine's description: {(done.stderr or done.stdout).strip()[-500:]}")


def plan_fits(overrides: Sequence[str]) -> Optional[dict[str, Any]]:
    """`dtlaunch plan --json` for a job: the planner's verdict and peak, or None if it failed."""
    done = subprocess.run(
        [*console("dtlaunch", "dtlaunch"), "plan", *overrides, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    match = re.search(r"^\{.*^\}", done.stdout, re.S | re.M)
    return json.loads(match.group(0)) if match else None


class DeviceMemoryWatch:
    """Peak of nvidia-smi's memory.used (all GPUs' largest) while a run is on the device: what the
    process really holds, CUDA context and the allocator's cache included (max_memory_allocated sees
    tensors only). None where there is no nvidia-smi (the rehearsal on CPU)."""

    def __init__(self, period_ms: int = 200) -> None:
        self.period_ms = period_ms
        self.peak_mib: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> DeviceMemoryWatch:
        exe = shutil.which("nvidia-smi")
        if exe:
            cmd = [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                mib = int(float(line.strip()))
            except ValueError:
                continue
            self.peak_mib = mib if self.peak_mib is None else max(self.peak_mib, mib)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @staticmethod
    def idle_mib() -> Optional[int]:
        """memory.used before anything of ours is on the device (subtracted from each run's peak)."""
        exe = shutil.which("nvidia-smi")
        if not exe:
            return None
        done = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        values = [int(float(v)) for v in done.stdout.split() if v.replace(".", "", 1).isdigit()]
        return max(values) if values else None


def measure(
    run: Run, side: str, work: Path, warmup: int, timeout: Optional[float], idle_mib: Optional[int]
) -> dict[str, Any]:
    """One run of dtlaunch (or the hand-written loop on the same job): tokens/s, MFU, memory."""
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.models.flops import flops_per_token

    cfg = throughput.composed(list(run.overrides))
    nproc = int(cfg.launch.nproc_per_node)
    run_dir = work / f"{run.name}-{side}"
    run_dir.mkdir(parents=True, exist_ok=True)
    # Every trained row of a step (objective=grpo's rows accumulate over micro-batches).
    tokens_per_step = Decisions.of(cfg, Layout.resolve(cfg.strategy, nproc)).global_batch * int(cfg.training.seq_len)
    if side == "dtlaunch":
        cmd = [*console("dtlaunch", "dtlaunch"), "train", *run.overrides, f"run.dir={run_dir}", "--force"]
        metrics = run_dir / "metrics.jsonl"
    else:
        cmd = [
            *console("torchrun", "torch.distributed.run"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(BENCH / "handwritten.py"),
            *throughput.handwritten_args(cfg, run_dir / "model.yaml"),
            f"--metrics-file={run_dir / 'hw-metrics.jsonl'}",
        ]
        metrics = run_dir / "hw-metrics.jsonl"
    log = run_dir / "out.log"
    with DeviceMemoryWatch() as watch:
        res = throughput.run_one(
            side, cmd, {"DTLAUNCH_PROGRESS": "plain"}, metrics, log, tokens_per_step, warmup, timeout=timeout
        )
    peak_tflops = float(cfg.hardware.peak_tflops_bf16)
    fpt = flops_per_token(cfg.model, int(cfg.training.seq_len))
    out: dict[str, Any] = {
        **identity(run, side),
        "command": res.command,
        "seq_len": int(cfg.training.seq_len),
        "tokens_per_s": res.tokens_per_s,
        "step_s": res.step_s,
        "mfu": res.tokens_per_s * fpt / (peak_tflops * 1e12 * nproc) if res.tokens_per_s and peak_tflops else None,
        "first_step_s": res.first_step_s,
        "wall_s": res.wall_s,
        "error": res.error,
        "device_used_peak_bytes": (watch.peak_mib - (idle_mib or 0)) * 2**20 if watch.peak_mib is not None else None,
    }
    if res.error and log.exists():  # the run's own output, for a failure read from the JSON alone
        lines = log.read_text(errors="replace").strip().splitlines()
        out["log_tail"] = lines[-40:]
        cause = first_exception(lines)
        if cause and res.error.startswith("exit"):
            out["error"] = f"{res.error.split(':', 1)[0]}: {cause}"[:300]
    plan_file, summary_file = run_dir / "plan.json", run_dir / "summary.json"
    if side == "dtlaunch" and plan_file.exists():
        plan = json.loads(plan_file.read_text())
        out.update(predicted_bytes=plan["peak_bytes"], predicted_device_total_bytes=plan["device_total_bytes"])
        out["predicted_phase"] = plan.get("peak_phase")
    if side == "dtlaunch" and not res.error and summary_file.exists():
        summary = json.loads(summary_file.read_text())
        measured = max(summary["peak_mem_bytes_per_rank"])
        out["measured_bytes"] = measured
        reserved = max(summary.get("peak_reserved_bytes_per_rank") or [0])  # 0 on CPU: no caching allocator
        out["measured_reserved_bytes"] = reserved or None
        for key in ("generated_tokens_per_s", "generation_share"):  # objective=grpo's rollout
            if summary.get(key) is not None:
                out[key] = summary[key]
        if out.get("predicted_bytes") and measured:
            out["error_pct"] = (out["predicted_bytes"] - measured) / measured * 100
    elif side == "handwritten" and not res.error:
        m = re.search(r'"peak_mem_bytes_per_rank": \[([\d, ]+)\]', log.read_text())
        out["measured_bytes"] = max(int(x) for x in m.group(1).split(",")) if m else None
    status = out["error"] or f"{out['tokens_per_s']:,.0f} tok/s, MFU {100 * (out['mfu'] or 0):.1f} %"
    print(f"  {run.name:32s} {side:12s} {status} ({res.wall_s:.0f} s)", flush=True)
    return out


_EXCEPTION = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\b.*)")


def first_exception(lines: Sequence[str]) -> str:
    """The worker's own exception line ('ModuleNotFoundError: ...'), not torchrun's ChildFailedError report
    that ends the log; '' when there is none."""
    for line in lines:
        m = _EXCEPTION.match(line)
        if m and "ChildFailedError" not in m.group(1) and ":" in m.group(1):
            return m.group(1).strip()
    return ""


def identity(run: Run, side: str) -> dict[str, Any]:
    """The fields that name a result: which run, which side."""
    return {
        "name": run.name,
        "family": run.family,
        "compile": run.compile,
        "variant": run.variant,
        "part": run.part,
        "side": side,
    }


def skipped(run: Run, side: str, why: str) -> dict[str, Any]:
    print(f"  {run.name:32s} {side:12s} skipped: {why}", flush=True)
    return {
        **identity(run, side),
        "command": "",
        "tokens_per_s": None,
        "mfu": None,
        "error": "",
        "skipped": why,
    }


def skip_reason(
    run: Run, info: dict[str, Any], rehearse: bool, rehearse_compile: bool, left_s: Optional[float] = None
) -> str:
    """Why `run` is not started here ('' when it is); `left_s`: what is left of --budget-s, if any."""
    if run.part == MEMORY:
        why = memory_skip_reason(run)
        if why:
            return why
    if run.variant.startswith("float8"):
        if rehearse:
            return "float8 matmuls need CUDA (rehearsal on CPU)" + float8_api_check(run.variant)
        if not info.get("torchao"):
            return "torchao is not installed (bench/gpu/wheels.sh carries it to the GPU machine)"
        if tuple(info.get("capability") or (0, 0)) < (8, 9):
            return f"float8 needs compute capability 8.9+, this GPU has {info.get('capability')}"
    if rehearse and run.compile and not rehearse_compile:
        return "compile on CPU takes minutes per run (--rehearse-compile runs it)"
    if left_s is not None and left_s < MIN_START_S[run.compile]:
        return f"time budget spent ({left_s:.0f} s left)"
    return ""


def float8_api_check(variant: str) -> str:
    """In the rehearsal: whether torchao's float8 API that dtlaunch calls resolves for this recipe."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError:
        return "; torchao not installed here"
    Float8LinearConfig.from_recipe_name(variant.split("-", 1)[1])
    return "; torchao's float8 API resolves"


def render(report: dict[str, Any]) -> str:
    """The results file's Markdown: one row per side of each run, the dtlaunch / hand-written ratios,
    the AC trade-off read off the table, and every command."""
    info, results = report["machine"], report["runs"]
    unit, scale = ("MiB", 2**20) if report.get("rehearsal") else ("GiB", 2**30)  # tiny shapes: MiB

    def gib(v: Any) -> str:
        return f"{v / scale:.2f}" if v else "-"

    everything = results
    memory = [r for r in results if r.get("part") == MEMORY]
    results = [r for r in results if r.get("part") != MEMORY]
    rows = []
    for r in results:
        if r.get("skipped"):
            speed = f"skipped: {r['skipped']}"
        else:
            speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else (r["error"] or "?")[:100]
        rows.append(
            [
                r["name"],
                r["side"],
                speed,
                f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "-",
                gib(r.get("predicted_bytes")),
                gib(r.get("measured_bytes")),
                f"{r['error_pct']:+.1f} %" if r.get("error_pct") is not None else "-",
                gib(r.get("predicted_device_total_bytes")),
                gib(r.get("device_used_peak_bytes")),
            ]
        )
    headers = [
        "run",
        "side",
        "tokens/s",
        "MFU",
        f"plan {unit}",
        f"max_memory_allocated {unit}",
        "plan error",
        f"plan device total {unit}",
        f"nvidia-smi peak {unit}",
    ]
    title = "REHEARSAL on CPU (tiny shapes; not a measurement)" if report.get("rehearsal") else "GPU benchmark"
    total = f", {report['total_s']:.0f} s in all (start-up included)" if report.get("total_s") else ""
    lines = [
        f"# dtlaunch {title}, {info['date']}",
        "",
        f"- machine: {describe_machine(info)}; hardware={report['hardware']}; {report['nproc']} GPU(s)",
        f"- command: `{report['command']}`, {report['wall_s']:.0f} s of runs{total}",
    ]
    if results:
        lines += [
            f"- job: bf16, world {report['nproc']}, micro-batch {report['micro_batch']} x {report['seq_len']} tokens "
            f"per GPU, {report['steps']} steps, first {report['warmup']} excluded; one run per row",
            "",
            markdown_table(headers, rows),
        ]
    if memory:
        lines += ["", *memory_lines(memory, gib, unit, report)]
    lines += [
        "",
        *ratio_lines(results),
        "",
        *ac_lines(results),
        "",
        "Commands:",
        *[f"- {r['name']} / {r['side']}: `{r['command']}`" for r in everything if r.get("command")],
    ]
    return "\n".join(lines) + "\n"


def memory_lines(results: Sequence[dict[str, Any]], gib: Callable[[Any], str], unit: str, report: dict) -> list[str]:
    """The memory part's table: per feature, plan vs measured peak (allocated; the plan's device total
    vs the allocator's reserved peak), tokens/s against the baseline row of the same command, and both
    against the feature's reference row (the same job without the feature)."""
    by = {r["variant"]: r for r in results if r.get("tokens_per_s")}

    def ratio(r: dict[str, Any], ref: Optional[dict[str, Any]], key: str) -> str:
        return f"{r[key] / ref[key]:.3f}" if ref and r.get(key) and ref.get(key) else "-"

    rows = []
    for r in results:
        alloc, reserved = r.get("measured_bytes"), r.get("measured_reserved_bytes")
        total = r.get("predicted_device_total_bytes")
        if r.get("skipped"):
            speed = f"skipped: {r['skipped']}"
        else:
            speed = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else (r.get("error") or "?")[:160]
        ref_name = MEMORY_REFERENCE.get(r["variant"], "")
        base, ref = by.get("baseline"), by.get(ref_name)
        rows.append(
            [
                r["variant"],
                ref_name or "-",
                f"{r['seq_len']:,}" if r.get("seq_len") else "-",
                speed,
                ratio(r, base, "tokens_per_s"),
                ratio(r, ref, "tokens_per_s"),
                gib(r.get("predicted_bytes")),
                gib(alloc),
                f"{r['error_pct']:+.1f} %" if r.get("error_pct") is not None else "-",
                ratio(r, ref, "measured_bytes"),
                gib(total),
                gib(reserved),
                f"{(total - reserved) / reserved * 100:+.1f} %" if total and reserved else "-",
                gib(r.get("device_used_peak_bytes")),
            ]
        )
    headers = [
        "feature",
        "reference",
        "seq_len",
        "tokens/s",
        "vs baseline",
        "vs reference",
        f"plan peak {unit}",
        f"max_memory_allocated {unit}",
        "plan error",
        "allocated vs reference",
        f"plan device total {unit}",
        f"max_memory_reserved {unit}",
        "device total vs reserved",
        f"nvidia-smi peak {unit}",
    ]
    shape = "REHEARSAL_SHAPE (tiny, CPU)" if report.get("rehearsal") else MEMORY_SHAPE
    steps, warmup = report.get("mem_steps", report["steps"]), report.get("mem_warmup", report["warmup"])
    return [
        "## Memory features (one GPU; each row = its reference row plus one feature)",
        "",
        f"- job: {shape}, {steps} steps, first {warmup} excluded from tokens/s; the baseline has"
        " training.loss_chunks=1 (where the schema has it); plan error = (plan - measured) / measured; the plan's"
        " device total adds the CUDA context and allocator overheads to the peak, compared here with the"
        " allocator's reserved peak (the context is not in it); the longctx rows: micro-batch 1 at the longest"
        " seq_len the plan fits on this GPU (full AC, activation offload, loss chunks 8, the plan's MLP tiles),"
        f" {LONG_STEPS} steps, the first {LONG_STEPS // 2} excluded",
        "",
        markdown_table(headers, rows),
        *grpo_lines(results),
    ]


def grpo_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """objective=grpo rows: the rollout's generated tokens/s and share of the step, and the phase the plan
    peaks in (the table's plan error compares that phase's plan with the run's measured peak)."""
    out = [
        f"- {r['variant']}: plan peak in {r.get('predicted_phase') or '?'}; generated "
        f"{r['generated_tokens_per_s']:,.0f} tokens/s, generation {100 * (r.get('generation_share') or 0):.0f} % "
        "of the run's time"
        for r in results
        if r.get("generated_tokens_per_s")
    ]
    return ["", *out] if out else []


MEMORY_SHAPE = "Llama-3.1-8B width, 4 layers, vocabulary 128,256, bf16, one rank, micro-batch 2 x 2048 tokens"


def ratio_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for name in dict.fromkeys(r["name"] for r in results):
        pair = {r["side"]: r["tokens_per_s"] for r in results if r["name"] == name}
        if pair.get("dtlaunch") and pair.get("handwritten"):
            out.append(f"- {name}: dtlaunch / hand-written tokens/s = {pair['dtlaunch'] / pair['handwritten']:.3f}")
    return out


def ac_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """Selective AC against none and full, per model and compile mode: the goal is op-SAC faster than
    full AC (speed ratio > 1) with less memory than none (memory ratio < 1)."""
    by: dict[tuple[str, bool], dict[str, dict[str, Any]]] = {}
    for r in results:
        if r["side"] == "dtlaunch" and r.get("tokens_per_s"):
            by.setdefault((r["family"], r["compile"]), {})[r["variant"]] = r
    out = []
    for (family, compiled), v in by.items():
        none, full = v.get("ac-none"), v.get("ac-full")
        for sel in ("ac-op", "ac-layer", "budget-0.5"):
            s = v.get(sel)
            if not s:
                continue
            parts = []
            if full:
                parts.append(f"tokens/s vs full AC {s['tokens_per_s'] / full['tokens_per_s']:.3f}")
            if none:
                parts.append(f"tokens/s vs none {s['tokens_per_s'] / none['tokens_per_s']:.3f}")
                if s.get("measured_bytes") and none.get("measured_bytes"):
                    parts.append(f"memory vs none {s['measured_bytes'] / none['measured_bytes']:.3f}")
            if parts:
                out.append(f"- {family} {'compiled' if compiled else 'eager'}, {sel}: " + ", ".join(parts))
    return ["Selective AC (goal: faster than full AC, less memory than none):", *out] if out else []


def result_stem(device: str, part: int | str, when: Optional[datetime] = None) -> str:
    date = (when or datetime.now(timezone.utc)).strftime("%Y-%m-%d")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"gpu-{date}-{slug}" + (f"-{MEMORY}" if part == MEMORY else f"-part{part}" if part else "")


def write_report(report: dict[str, Any], out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(render(report))
    write_json(out_dir / f"{stem}.json", report)
    return out_dir / f"{stem}.md"


def merge(files: Sequence[Path], out_dir: Path) -> Path:
    """One results file from the parts' JSON files (one GPU session runs the parts as separate commands)."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    reports.sort(key=lambda r: str(r.get("part") or 0))
    merged = dict(reports[0], part=0, runs=[run for r in reports for run in r["runs"]])
    merged["wall_s"] = sum(r["wall_s"] for r in reports)
    merged["total_s"] = sum(r.get("total_s") or 0.0 for r in reports)
    merged["command"] = " ; ".join(r["command"] for r in reports)
    stem = re.sub(rf"-(part\d+|{MEMORY})$", "", Path(files[0]).stem)
    return write_report(merged, out_dir, stem)


def all_runs(
    nproc: int,
    hw: str,
    steps: int,
    mem_steps: int,
    fits: Callable[[tuple[str, ...]], bool],
    part: int | str,
    host_gib: float = 0.0,
) -> list[Run | LargestFitting]:
    """Parts 1 and 2 (`run_list`), then the memory part, as `--part` selects (0: all)."""
    runs: list[Run | LargestFitting] = run_list(nproc, hw, steps, fits) if part != MEMORY else []
    if part in (0, MEMORY):
        runs += memory_runs(hw, mem_steps, host_gib, gpus=nproc)
    return runs


def dry_run(
    device_name: str,
    nproc: int,
    steps: int,
    only: set[str] | None = None,
    part: int | str = 0,
    mem_steps: int = MEM_STEPS,
) -> list[dict[str, Any]]:
    """Every run composed, validated and planned in this process (no GPU, no torch.cuda): what the real
    benchmark would run, with the plan it would compare against; memory rows that validation refuses
    here are listed with the reason (the real run skips them the same way)."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    hw = hardware_option(device_name)
    plans: dict[tuple[str, ...], Any] = {}

    def plan(overrides: tuple[str, ...]) -> Any:
        if overrides not in plans:
            job_ = load_job(list(overrides))
            plans[overrides] = plan_memory(job_.cfg, job_.layout)
        return plans[overrides]

    rows = []
    for r in selected(all_runs(nproc, hw, steps, mem_steps, lambda ov: plan(ov).fits, part), only or set(), part):
        why = memory_skip_reason(r) if r.part == MEMORY else ""
        if why:
            rows.append({"name": r.name, "sides": list(r.sides), "skipped": why, "part": r.part})
            print(f"  {r.name:32s} part {r.part} skipped: {why}")
            continue
        p = plan(r.overrides)
        rows.append(
            {
                "name": r.name,
                "sides": list(r.sides),
                "predicted_bytes": p.peak,
                "predicted_device_total_bytes": p.device_total,
                "fits": p.fits,
                "part": r.part,
                "seq_len": seq_len(r),
            }
        )
        print(
            f"  {r.name:32s} part {r.part} {'+'.join(r.sides):22s} seq_len {seq_len(r):7d} plan {p.peak / 2**30:7.2f} GiB "
            f"(device total {p.device_total / 2**30:6.2f}) {'fits' if p.fits else 'DOES NOT FIT'}"
        )
    return rows


def parse_part(text: str) -> int | str:
    """--part: 1, 2, memory, or 0 / '' (all)."""
    text = text.strip().lower()
    if text in ("", "0"):
        return 0
    if text in ("1", "2"):
        return int(text)
    if text in (MEMORY, "mem"):
        return MEMORY
    raise SystemExit(f"--part {text!r}: use 1, 2 or {MEMORY}")


def main(argv: list[str] | None = None) -> Path | None:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=0, help="steps per run (default 30, memory part 12; 6 with --rehearse)"
    )
    ap.add_argument(
        "--warmup", type=int, default=-1, help="steps excluded from tokens/s (default 10, memory part 4; 2 rehearsed)"
    )
    ap.add_argument("--only", default="", help="comma-separated run names (e.g. 1b-eager-ac-none,largest-fitting)")
    ap.add_argument("--part", default="0", help="run only this part: 1, 2 or memory (default: all)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=-1,
        help=f"start no run past this many seconds (0: no limit; default 0, memory part {MEM_BUDGET_S:.0f})",
    )
    ap.add_argument(
        "--run-timeout",
        type=float,
        default=0,
        help=f"stop a run after this long (default 360 s, memory part {MEM_RUN_TIMEOUT_S:.0f} s)",
    )
    ap.add_argument("--results-dir", default="", help="default bench/results (a temporary dir with --rehearse)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: compose, validate and plan every run")
    ap.add_argument("--device-name", default="NVIDIA H100 80GB HBM3", help="--dry-run/--rehearse: GPU to plan for")
    ap.add_argument("--rehearse", action="store_true", help="CPU: every run end to end at tiny shapes")
    ap.add_argument("--rehearse-compile", action="store_true", help="--rehearse: compiled runs too (slow)")
    ap.add_argument("--merge", nargs="+", default=[], help="part JSON files to merge into one results file")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    part = parse_part(args.part)
    memory_only = part == MEMORY
    steps = args.steps or (6 if args.rehearse else MEM_STEPS if memory_only else 30)
    mem_steps = args.steps or (6 if args.rehearse else MEM_STEPS)
    warmup = args.warmup if args.warmup >= 0 else (2 if args.rehearse else MEM_WARMUP if memory_only else 10)
    mem_warmup = args.warmup if args.warmup >= 0 else (2 if args.rehearse else MEM_WARMUP)
    budget_s = args.budget_s if args.budget_s >= 0 else (MEM_BUDGET_S if memory_only and not args.rehearse else 0)
    if args.merge:
        path = merge([Path(f) for f in args.merge], Path(args.results_dir) if args.results_dir else BENCH / "results")
        print(f"merged into {path}")
        return path
    if args.dry_run:
        dry_run(args.device_name, 1, steps, only, part, mem_steps)
        print(f"dry run: {time.perf_counter() - started:.1f} s")
        return None

    info = device_info()
    if args.rehearse:
        nproc, device = 1, f"{args.device_name} (rehearsal on CPU)"
        out_dir = Path(args.results_dir or tempfile.mkdtemp(prefix="dtlaunch-gpu-rehearsal-"))
    else:
        if not info["gpus"]:
            sys.exit("bench/gpu needs a CUDA GPU and a CUDA build of torch (this torch sees none); --rehearse on CPU")
        nproc, device = len(info["gpus"]), info["gpus"][0]
        out_dir = Path(args.results_dir) if args.results_dir else BENCH / "results"
    hw = hardware_option(device)
    # The memory rows plan activation / CPU offload's host bytes against this machine's RAM, not the profile's.
    host_gib = 0.0 if args.rehearse else float(info.get("memory_gib") or 0.0)
    print(describe_machine(info), f"-> hardware={hw}, {nproc} GPU(s)", flush=True)

    def fits(overrides: tuple[str, ...]) -> bool:
        return bool((plan_fits(shrink(overrides) if args.rehearse else overrides) or {}).get("fits"))

    runs = selected(all_runs(nproc, hw, steps, mem_steps, fits, part, host_gib), only, part)
    if args.rehearse:
        runs = [Run(r.family, r.compile, r.variant, rehearsal_overrides(r), r.sides, r.part) for r in runs]
    t0 = time.perf_counter()
    deadline = started + budget_s if budget_s else None  # the budget counts this process's own start-up too
    cap = args.run_timeout or (1800.0 if args.rehearse else MEM_RUN_TIMEOUT_S if memory_only else 360.0)
    work = Path(tempfile.mkdtemp(prefix="dtlaunch-gpu-bench-"))
    shape = throughput.composed(list(runs[0].overrides)).training if runs else {}
    report: dict[str, Any] = {
        "machine": info,
        "device": device,
        "hardware": hw,
        "nproc": nproc,
        "part": part,
        "rehearsal": args.rehearse,
        "steps": steps,
        "warmup": warmup,
        "budget_s": budget_s,
        "mem_steps": mem_steps,
        "mem_warmup": mem_warmup,
        "micro_batch": int(shape["micro_batch"]) if runs else None,
        "seq_len": int(shape["seq_len"]) if runs else None,
        "command": " ".join(["bench/gpu/gpu_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "runs": [],
        "wall_s": 0.0,
        "total_s": 0.0,
    }
    stem = result_stem(device, part)
    idle = DeviceMemoryWatch.idle_mib()
    try:
        for run in runs:
            for side in run.sides:
                left = deadline - time.perf_counter() if deadline else None
                why = skip_reason(run, info, args.rehearse, args.rehearse_compile, left)
                if why:
                    report["runs"].append(skipped(run, side, why))
                    continue
                timeout = min(cap, left) if left is not None else cap
                # A row with its own few steps (long context) measures its second half.
                w = min(mem_warmup, steps_of(run, mem_steps) // 2) if run.part == MEMORY else warmup
                report["runs"].append(measure(run, side, work, w, timeout, idle))
                report["wall_s"] = time.perf_counter() - t0
                report["total_s"] = time.perf_counter() - started
                write_report(report, out_dir, stem)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t0
    report["total_s"] = time.perf_counter() - started
    path = write_report(report, out_dir, stem)
    print(render(report))
    print(f"results: {path} and {path.with_suffix('.json')}")
    limit = f" (budget {budget_s:.0f} s)" if budget_s else ""
    print(f"total: {report['total_s']:.0f} s, start-up and every run included{limit}", flush=True)
    return path


if __name__ == "__main__":
    main()
