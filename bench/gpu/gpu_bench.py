"""GPU benchmark (H100/H200; ~30 minutes): tokens/s and MFU of a ~1.2B Llama (Llama-3.2-1B shape) in bf16
with FSDP2 over every visible GPU (a single GPU trains it unwrapped, as dtlaunch does for a world of one),
compile off/on, activation checkpointing none / selective (op and layer policies, compile's memory
budget) / full; truncated Llama-3.1-8B and -70B shapes (their real widths, few layers, so they fit one
device) under the same AC and compile variants; the planner's prediction (plan.json, the same figure
`dtlaunch plan --json` prints) against the measured torch.cuda.max_memory_allocated (summary.json); the
hand-written loop on the same job (eager and compiled); and the largest model the planner says fits.

    bash bench/gpu/run.sh            # or: make bench-gpu; python bench/gpu/gpu_bench.py [--steps 40] [--only 1b-eager]
    python bench/gpu/gpu_bench.py --dry-run [--device-name "NVIDIA H100 80GB HBM3"]   # CPU: list + plan each run

Writes bench/results/gpu-<date>-<device>.md and .json. Never run by CI.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import throughput  # noqa: E402
from bench.common import BENCH, ROOT, describe_machine, machine_info, markdown_table, venv_bin, write_json  # noqa: E402

# Llama-3.2-1B's shape (untied output head: 1.50B parameters, 1.24B of them in matmuls).
LLAMA_1B = [
    "model=llama3_8b",
    "model.name=llama_1b",
    "model.dim=2048",
    "model.n_layers=16",
    "model.n_heads=32",
    "model.n_kv_heads=8",
]
# Candidates for "the largest that fits", biggest first; the planner picks (fits on the detected GPU).
LLAMA_3B = ["model=llama3_8b", "model.name=llama_3b", "model.dim=3072", "model.n_layers=28", "model.n_heads=24"]
LARGER = [("llama3_8b", ["model=llama3_8b"]), ("llama_3b", LLAMA_3B)]
# Real widths, truncated depth: the per-layer activations and weights of the big models on one device.
LLAMA_8B_4L = ["model=llama3_8b", "model.name=llama3_8b_4l", "model.n_layers=4"]
LLAMA_70B_2L = ["model=llama3_70b", "model.name=llama3_70b_2l", "model.n_layers=2"]
SEL = "training.activation_checkpointing=selective"
FULL = "training.activation_checkpointing=full"
COMPILE = "training.compile=true"
BOTH = ("dtlaunch", "handwritten")


def run_list(nproc: int, hw: str, steps: int, fits: Any) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """(name, dtlaunch overrides, sides) of every run; `fits(overrides)` -> bool picks the largest model."""
    base = dict(nproc=nproc, hw=hw, steps=steps)
    runs: list[tuple[str, list[str], tuple[str, ...]]] = [
        ("1b-eager", job(LLAMA_1B, extra=[], **base), BOTH),
        ("1b-compile", job(LLAMA_1B, extra=[COMPILE], **base), BOTH),
        ("1b-eager-ac-op", job(LLAMA_1B, extra=[SEL], **base), ("dtlaunch",)),
        ("1b-eager-ac-layer2", job(LLAMA_1B, extra=[SEL, "training.ac_policy=layer"], **base), ("dtlaunch",)),
        ("1b-eager-ac-full", job(LLAMA_1B, extra=[FULL], **base), ("dtlaunch",)),
        ("1b-compile-ac-op", job(LLAMA_1B, extra=[SEL, COMPILE], **base), ("dtlaunch",)),
        ("1b-compile-ac-full", job(LLAMA_1B, extra=[FULL, COMPILE], **base), ("dtlaunch",)),
        (
            "1b-compile-budget-0.5",
            job(LLAMA_1B, extra=[SEL, COMPILE, "training.ac_memory_budget=0.5"], **base),
            ("dtlaunch",),
        ),
    ]
    for tag, model in (("8b-4l", LLAMA_8B_4L), ("70b-2l", LLAMA_70B_2L)):
        for ac_tag, ac in (("ac-none", []), ("ac-op", [SEL]), ("ac-full", [FULL])):
            for c_tag, comp in (("eager", []), ("compile", [COMPILE])):
                runs.append((f"{tag}-{c_tag}-{ac_tag}", job(model, extra=[*ac, *comp], **base), ("dtlaunch",)))
    for name, model in LARGER:  # the largest the planner says fits, with full AC
        overrides = job(model, extra=[FULL], **base)
        if fits(overrides):
            runs.append((f"largest-fitting-{name}-ac-full", overrides, ("dtlaunch",)))
            break
    return runs


def dry_run(device_name: str, nproc: int, steps: int, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every run composed, validated and planned in this process (no GPU, no torch.cuda): what the real
    benchmark would run, with the plan it would compare against."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    hw = hardware_option(device_name)
    plans: dict[tuple[str, ...], Any] = {}

    def plan(overrides: list[str]) -> Any:
        key = tuple(overrides)
        if key not in plans:
            job_ = load_job(overrides)
            plans[key] = plan_memory(job_.cfg, job_.layout)
        return plans[key]

    rows = []
    for name, overrides, sides in run_list(nproc, hw, steps, lambda ov: plan(ov).fits):
        if only and name not in only:
            continue
        p = plan(overrides)
        rows.append(
            {"name": name, "sides": list(sides), "predicted_bytes": p.peak, "fits": p.fits, "overrides": overrides}
        )
        print(
            f"  {name:32s} {'+'.join(sides):22s} plan {p.peak / 2**30:7.2f} GiB {'fits' if p.fits else 'DOES NOT FIT'}"
        )
    return rows


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


def job(model: list[str], nproc: int, hw: str, steps: int, extra: list[str]) -> list[str]:
    return [
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
        *extra,
    ]


def plan_fits(overrides: list[str]) -> Optional[dict[str, Any]]:
    """`dtlaunch plan --json` for a job: the planner's verdict and peak, or None if it failed."""
    done = subprocess.run(
        [venv_bin("dtlaunch"), "plan", *overrides, "--json"], cwd=ROOT, capture_output=True, text=True
    )
    match = re.search(r"^\{.*^\}", done.stdout, re.S | re.M)
    return json.loads(match.group(0)) if match else None


def measure(name: str, side: str, overrides: list[str], work: Path, warmup: int) -> dict[str, Any]:
    """One run of dtlaunch (or the hand-written loop on the same job): tokens/s, MFU, memory."""
    from dtlaunch.models.flops import flops_per_token

    cfg = throughput.composed(overrides)
    nproc = int(cfg.launch.nproc_per_node)
    run_dir = work / f"{name}-{side}"
    run_dir.mkdir(parents=True, exist_ok=True)
    tokens_per_step = int(cfg.training.micro_batch) * nproc * int(cfg.training.seq_len)
    if side == "dtlaunch":
        cmd = [venv_bin("dtlaunch"), "train", *overrides, f"run.dir={run_dir}", "--force"]
        metrics = run_dir / "metrics.jsonl"
    else:
        cmd = [
            venv_bin("torchrun"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(BENCH / "handwritten.py"),
            *throughput.handwritten_args(cfg, run_dir / "model.yaml"),
            f"--metrics-file={run_dir / 'hw-metrics.jsonl'}",
        ]
        metrics = run_dir / "hw-metrics.jsonl"
    res = throughput.run_one(
        side, cmd, {"DTLAUNCH_PROGRESS": "plain"}, metrics, run_dir / "out.log", tokens_per_step, warmup
    )
    peak_tflops = float(cfg.hardware.peak_tflops_bf16)
    fpt = flops_per_token(cfg.model, int(cfg.training.seq_len))
    out: dict[str, Any] = {
        "name": name,
        "side": side,
        "command": res.command,
        "tokens_per_s": res.tokens_per_s,
        "mfu": res.tokens_per_s * fpt / (peak_tflops * 1e12 * nproc) if res.tokens_per_s and peak_tflops else None,
        "first_step_s": res.first_step_s,
        "wall_s": res.wall_s,
        "error": res.error,
    }
    if side == "dtlaunch" and not res.error:
        plan = json.loads((run_dir / "plan.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        measured = max(summary["peak_mem_bytes_per_rank"])
        out.update(predicted_bytes=plan["peak_bytes"], measured_bytes=measured)
        out["error_pct"] = (plan["peak_bytes"] - measured) / measured * 100 if measured else None
    elif side == "handwritten" and not res.error:
        log = (run_dir / "out.log").read_text()
        m = re.search(r'"peak_mem_bytes_per_rank": \[([\d, ]+)\]', log)
        out["measured_bytes"] = max(int(x) for x in m.group(1).split(",")) if m else None
    print(
        f"  {name:28s} {side:12s} "
        + (out["error"] or f"{out['tokens_per_s']:,.0f} tok/s, MFU {100 * (out['mfu'] or 0):.1f} %"),
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10, help="excluded steps (a multiple of log_every=10)")
    ap.add_argument("--only", default="", help="comma-separated subset of run names (e.g. 1b-eager)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: compose, validate and plan every run")
    ap.add_argument("--device-name", default="NVIDIA H100 80GB HBM3", help="--dry-run: the GPU to plan for")
    args = ap.parse_args(argv)
    if args.dry_run:
        dry_run(args.device_name, 1, args.steps, {s for s in args.only.split(",") if s})
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu needs a CUDA GPU and a CUDA build of torch (this torch sees none)")
    info = machine_info()
    nproc = torch.cuda.device_count()
    hw = hardware_option(info["gpus"][0])
    print(describe_machine(info), f"-> hardware={hw}, {nproc} GPU(s)", flush=True)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="dtlaunch-gpu-bench-"))
    runs = run_list(nproc, hw, args.steps, lambda ov: bool((plan_fits(ov) or {}).get("fits")))
    only = {s for s in args.only.split(",") if s}
    results = []
    for name, overrides, sides in runs:
        if only and name not in only:
            continue
        for side in sides:
            results.append(measure(name, side, overrides, work, args.warmup))
    report = {"machine": info, "hardware": hw, "nproc": nproc, "steps": args.steps, "runs": results}
    report["wall_s"] = time.perf_counter() - t0
    rows = []
    for r in results:
        pred, meas = r.get("predicted_bytes"), r.get("measured_bytes")
        rows.append(
            [
                r["name"],
                r["side"],
                f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else r["error"][:80],
                f"{100 * r['mfu']:.1f} %" if r["mfu"] else "-",
                f"{pred / 2**30:.2f}" if pred else "-",
                f"{meas / 2**30:.2f}" if meas else "-",
                f"{r['error_pct']:+.1f} %" if r.get("error_pct") is not None else "-",
            ]
        )
    table = markdown_table(
        ["run", "side", "tokens/s", "MFU", "predicted GiB", "max_memory_allocated GiB", "plan error"], rows
    )
    ratios = []
    for name in {r["name"] for r in results}:
        pair = {r["side"]: r["tokens_per_s"] for r in results if r["name"] == name}
        if pair.get("dtlaunch") and pair.get("handwritten"):
            ratios.append(f"- {name}: dtlaunch / hand-written = {pair['dtlaunch'] / pair['handwritten']:.3f}")
    device = re.sub(r"[^a-z0-9]+", "-", info["gpus"][0].lower()).strip("-")
    stem = f"gpu-{datetime.now(timezone.utc).strftime('%Y-%m-%d')}-{device}"
    out_dir = BENCH / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    md = "\n".join(
        [
            f"# dtlaunch GPU benchmark, {info['date']}",
            "",
            f"- machine: {describe_machine(info)}; hardware={hw}; {nproc} GPU(s)",
            f"- command: `bash bench/gpu/run.sh` ({' '.join(sys.argv[1:]) or 'defaults'}), {report['wall_s']:.0f} s",
            f"- job: Llama 1B shape (and truncated 8B/70B shapes), bf16, FSDP2 (world {nproc}), micro-batch 4 "
            f"x 2048 tokens per GPU, {args.steps} steps, first {args.warmup} excluded; one run per row",
            "",
            table,
            "",
            *ratios,
            "",
            "Commands:",
            *[f"- {r['name']} / {r['side']}: `{r['command']}`" for r in results],
        ]
    )
    (out_dir / f"{stem}.md").write_text(md + "\n")
    write_json(out_dir / f"{stem}.json", report)
    print(md)


if __name__ == "__main__":
    main()
