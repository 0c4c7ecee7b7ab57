"""Ulysses sequence parallel (`strategy.cp_style=ulysses`) outside the workers: the layouts `validate`
refuses (one line, exit 2) or accepts, the K/V head count the runtime and the planner share, and the plan
(its exchange against ring attention's, and `plan --maximize training.seq_len` choosing the style). The
collectives run in tests/distributed/test_ulysses_layouts.py (gloo, parity with one process)."""

from __future__ import annotations

import pytest
from cli_in_process import run_cli

from dtlaunch.commands.common import load_job
from dtlaunch.config.layout import ulysses_kv_heads
from dtlaunch.plan.maximize import maximize
from dtlaunch.plan.memory import plan_memory

CP2 = ["recipe=tiny_fsdp", "strategy.cp=2", "strategy.dp_shard=1", "training.seq_len=32"]
ULYSSES = [*CP2, "strategy.cp_style=ulysses"]


@pytest.mark.parametrize(
    ("kv", "cp", "sent"),
    [(8, 8, 8), (8, 2, 8), (2, 4, 4), (1, 8, 8), (8, 16, 16), (3, 2, 6), (6, 4, 12)],
)
def test_kv_heads_repeat_only_where_cp_does_not_divide(kv: int, cp: int, sent: int) -> None:
    assert ulysses_kv_heads(kv, cp) == sent
    assert sent % cp == 0 and sent % kv == 0


def _validate(args: list[str]) -> tuple[int, str]:
    return run_cli(["validate", *args], stdout=True)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # 4 query heads over 8 CP ranks.
        (["recipe=tiny_fsdp", "launch.nproc_per_node=8", "strategy.cp=8", "strategy.dp_shard=1",
          "strategy.cp_style=ulysses"], "model.n_heads=4 does not divide by it"),
        # 4 heads, tp=2: 2 per TP rank, over cp=4.
        (["recipe=tiny_fsdp", "strategy=fsdp_tp", "launch.nproc_per_node=8", "strategy.cp=4", "strategy.dp_shard=1",
          "training.seq_len=64", "strategy.cp_style=ulysses"], "(2 per tensor-parallel rank)"),
        (["strategy.cp_style=sideways"], "strategy.cp_style"),
        ([*ULYSSES, "data.document_mask=true"], "data.document_mask=true"),
        ([*ULYSSES, "training.compile=true"], "training.compile=true"),
    ],
)  # fmt: skip
def test_refused_in_one_line(args: list[str], expected: str) -> None:
    code, err = run_cli(["validate", *args])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("dtlaunch: error: ") and expected in lines[0], err


def test_grouped_kv_heads_below_cp_are_accepted_with_a_note() -> None:
    code, out = _validate([*ULYSSES, "model.n_kv_heads=1"])
    assert code == 0, out
    assert "repeated to 2 heads" in out


@pytest.fixture(scope="module")
def hf(tiny_hf_dirs) -> dict[str, list[str]]:
    def model(family: str) -> list[str]:
        return ["model=tiny", "model.arch=hf_auto", f"model.init_from=hf:{tiny_hf_dirs[family]}"]

    return {f: model(f) for f in tiny_hf_dirs}


def test_hf_auto_runs_ulysses_not_ring(hf) -> None:
    assert _validate([*ULYSSES, *hf["qwen2"]])[0] == 0
    code, err = _validate([*CP2, *hf["qwen2"]])
    assert code == 2 and "use strategy.cp_style=ulysses for model.arch=hf_auto" in err, err


def test_hf_auto_sliding_window_shorter_than_the_sequence_is_refused(hf) -> None:
    # The tiny Mistral's window is 8 tokens; Ulysses' kernel attends over the whole sequence.
    code, err = _validate([*ULYSSES, *hf["mistral"]])
    assert code == 2 and "sliding_window=8 is shorter than training.seq_len=32" in err, err


# Llama-3.1-8B full fine-tune on 8 x H100, the sequence over all 8 (docs/long-context.md's row).
BIG = [
    "recipe=llama8b_fsdp",
    "strategy.cp=8",
    "training.activation_checkpointing=full",
    "training.micro_batch=1",
    "training.global_batch=1",
    "training.loss_chunks=8",  # the attention's difference, not auto's full-vocabulary pass where one fits
]
# The exchanges alone: without the GPU kernel's backward buffers, which Ulysses' flash call adds and ring's chunks
# do not (tests/unit/test_plan_vs_h200.py).
EXCHANGES = [*BIG, "hardware.gpus_per_node=0", "training.activation_offload=false"]


def _peak(args: list[str]) -> float:
    return _plan(args).peak


def test_plan_counts_the_all_to_all_not_the_gathered_sequence() -> None:
    """At 262,144 tokens (32,768 per rank) ring attention's backward holds the whole sequence's K/V
    repeated to 32 heads with fp32 gradients; Ulysses holds one rank's q, k, v (32 + 2 x 8 heads), three
    times over, in bf16: 2 x 6 x 4096 x 262,144 vs 3 x 2 x 6144 x 32,768 bytes."""
    at = [*EXCHANGES, "model.max_seq_len=262144", "training.seq_len=262144"]
    ring, ulysses = _peak(at), _peak([*at, "strategy.cp_style=ulysses"])
    want = 2 * 6 * 4096 * 262144 - 3 * 2 * 6144 * 32768
    assert ring - ulysses == pytest.approx(want, rel=1e-9)


def test_maximize_seq_len_considers_the_cp_style() -> None:
    """Ring attention is the default style; the search tries Ulysses too and says so in the overrides."""
    args = [*BIG, "model.max_seq_len=4000000"]
    found = maximize(load_job(args).cfg, "training.seq_len")
    assert found.savers[0] == "strategy.cp_style=ulysses", found.savers
    at = [*args, f"training.seq_len={found.value}", *found.savers[1:]]
    assert _plan(at + ["strategy.cp_style=ulysses"]).fits
    assert not _plan(at).fits  # ring attention at Ulysses' longest sequence


def _plan(args: list[str]):
    job = load_job(args)
    return plan_memory(job.cfg, job.layout, all_stages=False)
