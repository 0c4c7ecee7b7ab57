"""bench/ helpers that the suite's results files depend on: machine info, statistics, tables, the
steady-state throughput formula and the hand-written loop's flags. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import common, run_all, throughput  # noqa: E402


def test_machine_info_names_the_machine() -> None:
    info = common.machine_info()
    assert info["cores"] >= 1 and info["torch"] and info["cpu"] and info["date"].endswith("UTC")
    line = common.describe_machine(info)
    assert info["torch"] in line and f"{info['cores']} cores" in line


def test_stats_and_table() -> None:
    s = common.stats([3.0, 1.0, 2.0])
    assert (s["min"], s["median"], s["max"], s["n"]) == (1.0, 2.0, 3.0, 3)
    assert common.stats([])["median"] is None
    assert common.min_med_max(s) == "2.00 (1.00–3.00)"
    table = common.markdown_table(["a", "b"], [["x|y", 12345.6], [None, True]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 12,346 |", "| - | yes |"]


def test_steady_tokens_per_s_uses_the_window_after_warmup() -> None:
    lines = [{"step": s, "elapsed_s": 10.0 + s * 0.5} for s in range(1, 21)]
    lines[0]["elapsed_s"] = 0.0  # a slow first step must not count
    assert throughput.steady_tokens_per_s(lines, tokens_per_step=100, warmup=10) == pytest.approx(200.0)
    assert throughput.steady_tokens_per_s(lines[:5], tokens_per_step=100, warmup=10) is None


def test_handwritten_flags_follow_the_dtlaunch_config(tmp_path: Path) -> None:
    cfg = throughput.composed(["recipe=tiny_fsdp", "training.steps=7", "optim.lr=0.01", "training.grad_clip=0.5"])
    args = throughput.handwritten_args(cfg, tmp_path / "model.yaml")
    assert {"--mode=fsdp", "--reshard-after-forward=1", "--steps=7", "--lr=0.01", "--grad-clip=0.5"} <= set(args)
    assert f"--micro-batch={cfg.training.micro_batch}" in args and "dim: 64" in (tmp_path / "model.yaml").read_text()


def test_summary_rows_render_goals() -> None:
    stat = common.stats([1000.0, 990.0])
    r = {
        "throughput": {
            "cases": [{"case": "c", "ratio": 0.99, "dtlaunch_tokens_per_s": stat, "handwritten_tokens_per_s": stat}]
        },
        "launch": [{"name": "dtlaunch --help", "goal_s": 0.3, "seconds": common.stats([0.5]), "error": ""}],
    }
    rows = run_all.summary_rows(r)
    assert rows[0][-1] == "yes" and rows[0][1].startswith("0.990")
    assert rows[1] == ["dtlaunch --help", "0.50 s", "< 0.3 s", "no"]
    r["launch"][0]["cpu_seconds"] = common.stats([0.25])  # beside the wall time: what a loaded machine hides
    assert run_all.summary_rows(r)[1][1:] == ["0.50 s (CPU 0.25 s)", "< 0.3 s CPU", "yes"]


def test_a_partial_run_replaces_its_rows_in_the_latest_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    monkeypatch.setattr(run_all, "BENCH", tmp_path)  # its README.md: none here
    machine = {"date": "2026-01-01", "cpu": "x", "cores": 2, "memory_gib": 1, "os": "L", "python": "3", "torch": "2"}
    launch = {"name": "dtlaunch --help", "goal_s": 0.3, "error": ""}
    full = {"machine": machine, "command": "make bench", "launch": [{**launch, "seconds": common.stats([0.5])}]}
    full["planner"] = {"rows": 3, "timed_out": False, "median_abs_error_pct": 1.0, "max_abs_error_pct": 2.0}
    (tmp_path / "cpu-2026-01-01.json").write_text(json.dumps(full))
    run_all.update_latest(full, "cpu-2026-01-01.md")
    partial = {"machine": {**machine, "date": "2026-01-02"}, "launch": [{**launch, "seconds": common.stats([0.2])}]}
    merged, base, note = run_all.merged_with_latest(partial, ["launch"], "cpu-2026-01-02.md")
    assert base == "cpu-2026-01-01.md" and "cpu-2026-01-02.md" in note
    rows = run_all.summary_rows(merged)
    assert rows[0][:2] == ["dtlaunch --help", "0.20 s"] and rows[1][0].startswith("planner accuracy (3 real runs")


def test_a_cpu_run_keeps_the_gpu_section_of_the_latest_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make bench` rewrites the CPU summary only: the GPU section bench/gpu's results added stays as it was."""
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    monkeypatch.setattr(run_all, "BENCH", tmp_path)
    machine = {"date": "2026-01-01", "cpu": "x", "cores": 2, "memory_gib": 1, "os": "L", "python": "3", "torch": "2"}
    launch = {"name": "dtlaunch --help", "goal_s": 0.3, "error": "", "seconds": common.stats([0.5])}
    gpu = "## GPU (one NVIDIA H200)\n\n| benchmark | result |\n|---|---|\n| step | 0.945 |\n"
    (tmp_path / "LATEST.md").write_text(f"# Latest benchmark results\n\nold CPU table\n\n{gpu}")
    run_all.update_latest({"machine": machine, "command": "make bench", "launch": [launch]}, "cpu-2026-01-02.md")
    text = (tmp_path / "LATEST.md").read_text()
    assert text.endswith(gpu) and "old CPU table" not in text and "cpu-2026-01-02.md" in text


def test_gpu_bench_dry_run_plans_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/gpu's CPU side: every run composes, validates and gets a plan that fits an H100."""
    from bench.gpu import gpu_bench

    runs = gpu_bench.run_list(1, "h100_80gb", 20, lambda overrides: True)
    names = [r.name for r in runs]
    assert len(names) == len(set(names)) and {"8b-4l-compile-budget-0.5", "70b-2l-compile-ac-op"} <= set(names)
    assert {r.part for r in runs} == {1, 2}
    some = {"1b-eager-ac-none", "1b-compile-ac-none", "8b-4l-eager-ac-op", "8b-4l-eager-ac-full", "8b-4l-eager-ac-none"}
    rows = gpu_bench.dry_run("NVIDIA H100 80GB HBM3", nproc=1, steps=20, only=some | {"70b-2l-compile-ac-op"})
    assert {r["name"] for r in rows} == some | {"70b-2l-compile-ac-op"} and all(r["fits"] for r in rows), rows
    by = {r["name"]: r["predicted_bytes"] for r in rows}
    # With training.loss_chunks=8 (the default) op-SAC's and full AC's peaks are the same end-of-backward
    # figure at this shape (gradients, state and the loss chunk's buffers), below no AC's.
    assert by["8b-4l-eager-ac-full"] <= by["8b-4l-eager-ac-op"] < by["8b-4l-eager-ac-none"]
    assert by["1b-compile-ac-none"] < by["1b-eager-ac-none"]
    assert gpu_bench.hardware_option("NVIDIA H200") == "h200_141gb"


@pytest.mark.slow_reason(
    "the GPU benchmark end to end on CPU: dtlaunch train and the hand-written loop under torchrun, one run each"
)
def test_gpu_bench_rehearsal_runs_the_whole_pipeline_on_cpu(tmp_path: Path) -> None:
    """`gpu_bench.py --rehearse`: the GPU benchmark's own code end to end on CPU at a tiny shape: both
    sides of a run (dtlaunch train, the hand-written loop under torchrun), the plan-vs-measured read-out,
    the results files and the merge of parts; runs that need CUDA are listed as skipped, not run."""
    from bench.gpu import gpu_bench

    only = "1b-eager-ac-none,8b-4l-compile-ac-op"
    md = gpu_bench.main(["--rehearse", "--part", "1", "--only", only, "--steps", "4", "--results-dir", str(tmp_path)])
    report = json.loads(md.with_suffix(".json").read_text())
    runs = {(r["name"], r["side"]): r for r in report["runs"]}
    assert set(runs) == {
        ("1b-eager-ac-none", "dtlaunch"),
        ("1b-eager-ac-none", "handwritten"),
        ("8b-4l-compile-ac-op", "dtlaunch"),
    }
    dt, hw = runs["1b-eager-ac-none", "dtlaunch"], runs["1b-eager-ac-none", "handwritten"]
    assert not dt["error"] and not hw["error"], (dt.get("log_tail"), hw.get("log_tail"))
    assert dt["tokens_per_s"] > 0 and hw["tokens_per_s"] > 0 and dt["measured_bytes"] > 0
    assert abs(dt["error_pct"]) < 25  # the plan of the tiny job against the CPU tracker's measured peak
    assert "compile" in runs["8b-4l-compile-ac-op", "dtlaunch"]["skipped"]
    text = md.read_text()
    assert md.name.endswith("-part1.md") and "REHEARSAL on CPU" in text and "dtlaunch / hand-written" in text
    merged = gpu_bench.merge([md.with_suffix(".json")], tmp_path)
    assert "-part" not in merged.name and json.loads(merged.with_suffix(".json").read_text())["runs"] == report["runs"]


def test_gpu_bench_skips_what_cannot_run() -> None:
    from bench.gpu import gpu_bench

    runs = {r.name: r for r in gpu_bench.run_list(1, "h100_80gb", 20, lambda overrides: True)}
    f8, eager = runs["8b-4l-compile-float8-rowwise"], runs["8b-4l-eager-ac-op"]
    h100 = {"torchao": "0.18.0", "capability": [9, 0]}
    assert gpu_bench.skip_reason(f8, h100, rehearse=False, rehearse_compile=False) == ""
    assert "torchao" in gpu_bench.skip_reason(f8, {"capability": [9, 0]}, False, False)
    assert "8.9" in gpu_bench.skip_reason(f8, {"torchao": "0.18.0", "capability": [8, 0]}, False, False)
    assert "CUDA" in gpu_bench.skip_reason(f8, {}, rehearse=True, rehearse_compile=True)
    assert "budget" in gpu_bench.skip_reason(eager, h100, False, False, left_s=10.0)
    assert gpu_bench.skip_reason(eager, h100, False, False, left_s=300.0) == ""
    shrunk = gpu_bench.shrink(eager.overrides)
    assert "model.dim=64" in shrunk and "training.seq_len=2048" not in shrunk and eager.variant == "ac-op"
    assert gpu_bench.first_exception(["x", "ModuleNotFoundError: No module named 'dtlaunch'", "y"]).startswith(
        "ModuleNotFoundError"
    )


def test_torchtitan_comparison_plans_every_published_config() -> None:
    from bench import torchtitan_compare

    assert len(torchtitan_compare.ROWS) == 9
    rows = [torchtitan_compare.plan_row(torchtitan_compare.ROWS[i]) for i in (0, 6, 8)]  # 8B, 70B, 405B
    assert all(r["planned_reserved_gib"] > 0 for r in rows)
    assert "| 8B FSDP 8, op-SAC |" in torchtitan_compare.table(rows)


def test_gpu_bench_memory_part_plans_each_feature_against_the_baseline() -> None:
    """`--part memory`: one GPU, each row the baseline plus one memory feature; rows this checkout or
    this checkout cannot run are skipped with validation's own reason."""
    from bench.gpu import gpu_bench

    assert (
        gpu_bench.parse_part("memory") == "memory" and gpu_bench.parse_part("2") == 2 and gpu_bench.parse_part("") == 0
    )
    runs = {r.variant: r for r in gpu_bench.memory_runs("h100_80gb", 12)}
    assert list(runs)[:2] == ["baseline", "loss-chunks-8"] and {"act-offload", "adamw8bit", "qlora"} <= set(runs)
    assert all(r.part == "memory" and "launch.nproc_per_node=1" in r.overrides for r in runs.values())
    assert ("training.loss_chunks=1" in runs["baseline"].overrides) == gpu_bench.schema_has("training.loss_chunks")
    assert gpu_bench.memory_skip_reason(runs["cpu-offload"]) == ""  # ZeRO-Offload on the one GPU
    refused = dataclasses.replace(runs["lora"], overrides=(*runs["lora"].overrides, "peft.rank=0"))
    assert "peft.rank" in gpu_bench.memory_skip_reason(refused)
    names = {f"mem-8b-4l-eager-{v}" for v in ("baseline", "lora", "act-offload")}
    rows = {r["name"]: r for r in gpu_bench.dry_run("NVIDIA H100 80GB HBM3", 1, 12, names, "memory")}
    assert set(rows) == names and all(r["fits"] for r in rows.values()), rows
    base = rows["mem-8b-4l-eager-baseline"]["predicted_bytes"]
    assert (
        rows["mem-8b-4l-eager-lora"]["predicted_bytes"] < rows["mem-8b-4l-eager-act-offload"]["predicted_bytes"] < base
    )
    assert gpu_bench.result_stem("NVIDIA H100", "memory").endswith("-nvidia-h100-memory")


def test_gpu_bench_long_context_rows_run_at_the_plans_longest_seq_len() -> None:
    """The longctx rows: one sequence at the seq_len `plan --maximize training.seq_len` gives for the bench's
    hardware profile, with the savers spelled out (activation offload explicit, whatever its default), and a
    steady window of their own few steps."""
    from bench.gpu import gpu_bench
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    runs = {r.variant: r for r in gpu_bench.memory_runs("h100_80gb", 12)}
    for variant in ("longctx-full", "longctx-qlora"):
        run = runs[variant]
        assert gpu_bench.memory_skip_reason(run) == ""
        job = load_job(list(run.overrides))
        t = job.cfg.training
        assert (str(t.activation_checkpointing), t.activation_offload, t.micro_batch) == ("full", True, 1)
        assert gpu_bench.seq_len(run) == t.seq_len > 2048 and t.mlp_tiles > 1
        assert plan_memory(job.cfg, job.layout).fits
        assert gpu_bench.steps_of(run, 12) == gpu_bench.LONG_STEPS and gpu_bench.steps_of(runs["baseline"], 12) == 12
    assert "peft.method=qlora" in runs["longctx-qlora"].overrides
    # On an 80 GB card both reach the model's own context; on a 40 GiB one the GPU binds: the longest that
    # fits, one token more does not; on 4 GiB nothing fits and the row asks for the longest (the gate refuses).
    row = tuple(o for o in runs["longctx-full"].overrides if not o.startswith(("training.seq_len", "training.mlp_")))
    smaller = gpu_bench.longest_context(gpu_bench.shrink(row, ("hardware.memory_gib=40",)))
    seq = gpu_bench.seq_len(dataclasses.replace(runs["longctx-full"], overrides=smaller))
    fit, longer = (load_job([*smaller, f"training.seq_len={n}"]) for n in (seq, seq + 1))
    assert 2048 < seq < fit.cfg.model.max_seq_len and plan_memory(fit.cfg, fit.layout).fits
    assert not plan_memory(longer.cfg, longer.layout).fits
    none_fit = gpu_bench.longest_context(gpu_bench.shrink(row, ("hardware.memory_gib=4",)))
    assert "training.seq_len=131072" in none_fit


def test_gpu_bench_memory_table_reads_against_the_baseline() -> None:
    from bench.gpu import gpu_bench

    def row(variant: str, tps: float, alloc: int, reserved: int, **kw: object) -> dict:
        ident = {"name": f"mem-{variant}", "family": "mem", "compile": False, "variant": variant}
        return {
            **ident,
            "part": "memory",
            "side": "dtlaunch",
            "command": "dtlaunch train",
            "error": "",
            "tokens_per_s": tps,
            "mfu": None,
            "measured_bytes": alloc,
            "measured_reserved_bytes": reserved,
            "predicted_bytes": alloc,
            "predicted_device_total_bytes": reserved + 2**30,
            "error_pct": 0.0,
            "seq_len": 2048,
            **kw,
        }

    report = {
        "machine": common.machine_info(),
        "hardware": "h100_80gb",
        "nproc": 1,
        "part": "memory",
        "steps": 12,
        "warmup": 4,
        "micro_batch": 2,
        "seq_len": 2048,
        "command": "gpu_bench.py --part memory",
        "wall_s": 300.0,
        "total_s": 310.0,
        "runs": [
            row("baseline", 1000.0, 20 * 2**30, 22 * 2**30),
            row("lora", 1500.0, 10 * 2**30, 11 * 2**30),
            row("longctx-full", 500.0, 40 * 2**30, 44 * 2**30, seq_len=131072),
            {**gpu_bench.skipped(gpu_bench.memory_runs("h100_80gb", 12)[-1], "dtlaunch", "needs 2 GPUs")},
        ],
    }
    text = gpu_bench.render(report)
    assert "## Memory features" in text and "310 s in all" in text and "skipped: needs 2 GPUs" in text
    assert (
        "| lora | baseline | 2,048 | 1,500 | 1.500 | 1.500 | 10.00 | 10.00 | +0.0 % | 0.500 | 12.00 | 11.00 | +9.1 % |"
        in text
    )
    assert "| longctx-full | - | 131,072 | 500 | 0.500 | - | 40.00 | 40.00 | +0.0 % | - | 45.00 | 44.00 |" in text


def test_race_pairs_each_repetition_with_its_hand_written_run() -> None:
    def run(side: str, tps: float, step: float) -> throughput.RunResult:
        return throughput.RunResult(side, tps, 1.0, 2.0, "cmd", step_s=step)

    # Two repetitions; a baseline side (--baseline) in the same alternation, order rotated.
    runs = [run("dtlaunch", 90.0, 0.020), run("handwritten", 100.0, 0.019), run("baseline", 95.0, 0.0195)]
    runs += [run("handwritten", 50.0, 0.040), run("baseline", 50.0, 0.040), run("dtlaunch", 49.0, 0.041)]
    paired = throughput.paired_ratios(runs)
    assert paired["whole_loop"] == pytest.approx([0.90, 0.98])
    assert paired["per_step"] == pytest.approx([0.95, 0.040 / 0.041])
    assert throughput.paired_ratios(runs, "baseline")["whole_loop"] == pytest.approx([0.95, 1.0])
    summary = throughput.summarize([throughput.CaseResult(throughput.RACE_CASES[0], runs)])
    assert summary["cases"][0]["paired"]["dtlaunch"]["median_whole_loop"] == pytest.approx(0.94)
    table = throughput.paired_table(summary).splitlines()
    assert len(table) == 4 and "| baseline | 0.974, 1.000 | 0.987 |" in table[3]


def test_the_sliced_race_drops_the_steps_its_side_spent_stopped() -> None:
    """bench/throughput_sliced.py: a step that spans the other side's turn is not a step time; every other
    step is, slow ones included (they move the whole-loop mean)."""
    from bench import throughput_sliced

    times, t = {}, 0.0
    for step in range(1, 41):
        t += 3.0 if step == 20 else (0.05 if step == 30 else 0.01)  # step 20 was stopped for a 3 s turn
        times[step] = t
    gaps = throughput_sliced.step_gaps(times, first=5, slice_s=3.0)
    assert len(gaps) == 34  # steps 6..40 but 20
    assert max(gaps) == pytest.approx(0.05) and min(gaps) == pytest.approx(0.01)


def test_the_sliced_race_stops_a_whole_process_tree() -> None:
    """torchrun's workers run in sessions of their own: the tree is found through parent links."""
    import os
    import subprocess

    from bench import throughput_sliced

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"])
    try:
        for _ in range(200):
            tree = throughput_sliced.descendants(child.pid)
            if len(tree) == 2:
                break
            __import__("time").sleep(0.02)
        assert tree[0] == child.pid and len(tree) == 2
        assert throughput_sliced.descendants(os.getpid())[0] == os.getpid()
    finally:
        throughput_sliced.signal_tree(child.pid, 9)
        child.wait()
