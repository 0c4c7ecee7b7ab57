"""Activation checkpointing's speed / memory trade-off on CPU: the proxy, until a GPU measures it, for
"selective AC is faster than full AC and takes less memory than none".

`dtlaunch train` (one process, fp32, synthetic data) of each model under activation_checkpointing none /
selective with ac_policy=op / selective with ac_policy=layer (every 2nd block) / full, repetitions
alternated (the order of the modes rotates each repetition, so a machine that gets busier or quieter
hurts every mode alike). Per mode: the step time, as the median and the minimum over the steps after the
warm-up of every repetition (the minimum is what a busy machine inflates least), and the peak memory the
worker measured (summary.json: tensor storages counted over the first steps, see train/memtrack.py)
next to the planner's figure (plan.json); then ratios against none and against full.

    python bench/ac_tradeoff.py [--models small,tiny] [--reps 3] [--steps 25] [--markdown FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import throughput
from bench.common import describe_machine, machine_info, markdown_table, this_command, venv_bin, write_json
from dtlaunch.run.metrics_file import read_metrics

SEL = "training.activation_checkpointing=selective"
MODES: dict[str, tuple[str, ...]] = {
    "none": (),
    "selective op": (SEL, "training.ac_policy=op"),
    "selective layer (every 2nd)": (SEL, "training.ac_policy=layer", "training.ac_every_n_layers=2"),
    "full": ("training.activation_checkpointing=full",),
}


def overrides(model: str, mode: str, steps: int, micro_batch: int, seq_len: int, threads: int) -> list[str]:
    return [
        f"model={model}",
        "strategy=ddp",
        "precision=fp32",
        "launch.nproc_per_node=1",
        f"launch.threads_per_worker={threads}",
        f"training.micro_batch={micro_batch}",
        f"training.seq_len={seq_len}",
        f"training.steps={steps}",
        "training.log_every=5",
        "training.loss_plot=false",
        "checkpoint=none",
        "data=synthetic",
        *MODES[mode],
    ]


def step_gaps(metrics: Path, warmup: int) -> list[float]:
    """Seconds between consecutive steps' `elapsed_s` after step `warmup` (the whole loop, per step)."""
    by_step = {int(r["step"]): float(r["elapsed_s"]) for r in read_metrics(metrics) if "elapsed_s" in r}
    return [by_step[s] - by_step[s - 1] for s in sorted(by_step) if s > warmup and s - 1 in by_step]


def one_run(model: str, mode: str, args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    run_dir = work / tag
    ov = overrides(model, mode, args.steps, args.micro_batch, args.seq_len, args.threads)
    cmd = [venv_bin("dtlaunch"), "train", *ov, f"run.dir={run_dir}", "--force"]
    tokens = args.micro_batch * args.seq_len
    res = throughput.run_one(
        "dtlaunch", cmd, {"DTLAUNCH_PROGRESS": "plain"}, run_dir / "metrics.jsonl", work / f"{tag}.log", tokens, 5
    )
    out: dict[str, Any] = {"model": model, "mode": mode, "command": res.command, "load": res.load, "error": res.error}
    if not res.error:
        out["gaps_s"] = step_gaps(run_dir / "metrics.jsonl", args.warmup)
        out["measured_bytes"] = max(json.loads((run_dir / "summary.json").read_text())["peak_mem_bytes_per_rank"])
        out["planned_bytes"] = json.loads((run_dir / "plan.json").read_text())["peak_bytes"]
    gaps = out.get("gaps_s") or [0.0]
    print(
        f"  {model:6s} {mode:28s} "
        + (
            res.error
            or f"step {1e3 * statistics.median(gaps):7.1f} ms (min {1e3 * min(gaps):.1f}), "
            f"peak {out['measured_bytes'] / 2**20:7.1f} MiB, load {res.load:.2f}"
        ),
        flush=True,
    )
    return out


def summarize(runs: Sequence[dict[str, Any]], models: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        per: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            ok = [r for r in runs if r["model"] == model and r["mode"] == mode and not r["error"]]
            gaps = [g for r in ok for g in r["gaps_s"]]
            if not gaps:
                continue
            per[mode] = {
                "model": model,
                "mode": mode,
                "step_median_s": statistics.median(gaps),
                "step_min_s": min(gaps),
                "measured_bytes": max(r["measured_bytes"] for r in ok),
                "planned_bytes": ok[0]["planned_bytes"],
                "reps": len(ok),
            }
        for row in per.values():
            for ref in ("none", "full"):
                if ref in per:
                    row[f"step_vs_{ref}"] = row["step_median_s"] / per[ref]["step_median_s"]
                    row[f"step_min_vs_{ref}"] = row["step_min_s"] / per[ref]["step_min_s"]
                    row[f"memory_vs_{ref}"] = row["measured_bytes"] / per[ref]["measured_bytes"]
            rows.append(row)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    def r(v: Optional[float]) -> str:
        return f"{v:.3f}" if v is not None else "-"

    return markdown_table(
        [
            "model",
            "AC",
            "step ms, median (min)",
            "peak MiB measured",
            "planned MiB",
            "step / none (min)",
            "step / full (min)",
            "memory / none",
            "memory / full",
        ],
        [
            [
                x["model"],
                x["mode"],
                f"{1e3 * x['step_median_s']:.1f} ({1e3 * x['step_min_s']:.1f})",
                f"{x['measured_bytes'] / 2**20:.1f}",
                f"{x['planned_bytes'] / 2**20:.1f}",
                f"{r(x.get('step_vs_none'))} ({r(x.get('step_min_vs_none'))})",
                f"{r(x.get('step_vs_full'))} ({r(x.get('step_min_vs_full'))})",
                r(x.get("memory_vs_none")),
                r(x.get("memory_vs_full")),
            ]
            for x in rows
        ],
    )


def write(runs: Sequence[dict[str, Any]], models: Sequence[str], args: argparse.Namespace, info: dict) -> dict:
    """The summary of the runs so far, written to --markdown / --json when given."""
    rows = summarize(runs, models)
    loads = [r["load"] for r in runs]
    head = (
        f"{describe_machine(info)}; 1-minute load {min(loads):.2f}–{max(loads):.2f} at the runs' starts\n\n"
        f"`{this_command()}`: one process, fp32, {args.threads} thread(s), micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, {args.steps} steps, steps after {args.warmup} timed, {len(runs)} runs "
        f"({args.reps} alternated repetitions per mode planned)"
    )
    text = head + "\n\n" + table(rows)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    report = {"machine": info, "args": vars(args), "rows": rows, "runs": list(runs), "text": text}
    if args.json:
        write_json(Path(args.json), report)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,tiny")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out (the memory tracker runs in 1-3)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of the worker (1: least preempted)")
    ap.add_argument("--markdown", default="", help="also write the table here")
    ap.add_argument("--json", default="", help="write every run here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    info = machine_info()
    print(describe_machine(info), flush=True)
    work = Path(tempfile.mkdtemp(prefix="dtlaunch-ac-tradeoff-"))
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {"text": "no run finished"}
    modes = list(MODES)
    try:
        for rep in range(args.reps):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotate: no mode always first
            for model in models:
                for mode in order:
                    runs.append(one_run(model, mode, args, work, f"{model}-{modes.index(mode)}-r{rep}"))
                    report = write(runs, models, args, info)  # after every run: an interrupted bench keeps it
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report["text"])
    errors = [f"{r['model']} {r['mode']}: {r['error']}" for r in runs if r["error"]]
    if errors:
        print("errors:\n" + "\n".join(errors))
    return report


if __name__ == "__main__":
    main()
