"""Throughput parity: `dtlaunch train` vs the hand-written loop (bench/handwritten.py) under torchrun.

Both train the same job: the hand-written script's settings (model YAML, micro-batch, sequence length,
AdamW hyper-parameters, schedule, grad clipping, dtype, ZeRO-3 resharding) are derived from the composed
dtlaunch config, so the two cannot drift apart. Both run with checkpoint=none, synthetic data, the same
OMP thread count per worker, and log every step. Runs alternate A/B (the order flips each repetition) so
a machine that gets busier or quieter hurts both alike.

Steady-state tokens/s of one run = tokens per step x (last - warmup) / (elapsed at last step - elapsed at
the warmup step), from the per-step `elapsed_s` each side writes after its step's metrics: the whole
loop counts (data, step, metrics, logging), not just the step function. The first `warmup` steps are
excluded (dtlaunch tracks memory over its first 3 steps on CPU; both allocate optimizer state at step 1).

The same runs give the launch overhead: wall time from starting the command to the first metrics line
appearing in the run's metrics file (polled every 5 ms; see bench/launch_overhead.py).

    python bench/throughput.py [--quick] [--reps 4] [--steps 200]
    python bench/throughput.py --race [--baseline DIR]   # DDP x2 tiny and model=small, 3 repetitions

`--race` is the parity race of dtlaunch issue #49: the two DDP cases, three alternated repetitions, each
repetition's pair giving a per-step ratio (hand-written / dtlaunch median step) and a whole-loop ratio
(dtlaunch / hand-written steady tokens/s); printed with the medians of those paired ratios, which a
machine others load moves less than a ratio of medians. `--baseline DIR` adds a third side in the same
alternation: `dtlaunch train` from another checkout (e.g. `git worktree add DIR d04c4ab`), its package
first on PYTHONPATH, so an old commit and this one race the same hand-written loop under the same noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, command_line, markdown_table, min_med_max, stats, usable_cores, venv_bin
from dtlaunch.run.metrics_file import read_metrics


@dataclass(frozen=True)
class Case:
    """One comparison: a dtlaunch recipe at a process count; the hand-written side mirrors its config."""

    recipe: str
    nproc: int
    extra: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        mode = {"tiny_ddp": "DDP", "tiny_fsdp": "FSDP2"}.get(self.recipe, self.recipe)
        # dtlaunch trains a world of one unwrapped (no DDP/FSDP for a single rank), and so does the reference.
        job = " ".join((self.recipe, *self.extra))
        return f"{'1 process' if self.nproc == 1 else f'{mode}, {self.nproc} processes'} ({job})"

    def tag(self, rep: int) -> str:
        """A directory name for one repetition: two cases of one recipe differ only by their overrides."""
        extra = "".join(f"-{x}" for x in self.extra).replace("=", "_").replace("/", "_")
        return f"{self.recipe}{extra}-n{self.nproc}-r{rep}"


CASES = (Case("tiny_ddp", 1), Case("tiny_ddp", 2), Case("tiny_fsdp", 2), Case("tiny_ddp", 2, ("model=small",)))
RACE_CASES = (CASES[1], CASES[3])  # --race: DDP over 2 processes, tiny and model=small


@dataclass
class RunResult:
    side: str  # "dtlaunch" | "handwritten" | "baseline" (dtlaunch from another checkout, --baseline)
    tokens_per_s: Optional[float]
    first_step_s: Optional[float]  # command start -> first metrics line on disk
    wall_s: float  # command start -> exit
    command: str
    error: str = ""
    steps_seen: int = 0
    step_s: Optional[float] = None  # median wall time of one step after the warm-up (whole loop)
    load: Optional[float] = None  # 1-minute load average when the run started (a shared machine's noise)


@dataclass
class CaseResult:
    case: Case
    runs: list[RunResult] = field(default_factory=list)

    def of(self, side: str) -> list[RunResult]:
        return [r for r in self.runs if r.side == side and not r.error]


def job_overrides(case: Case, steps: int, threads: int) -> list[str]:
    return [
        f"recipe={case.recipe}",
        f"launch.nproc_per_node={case.nproc}",
        f"launch.threads_per_worker={threads}",
        f"training.steps={steps}",
        "training.log_every=1",
        "checkpoint=none",
        "data=synthetic",
        *case.extra,
    ]


def composed(overrides: Sequence[str]) -> Any:
    from dtlaunch.job.compose import compose

    return compose(list(overrides)).cfg


def handwritten_args(cfg: Any, model_yaml: Path) -> list[str]:
    """The hand-written script's flags for the same job (everything that affects the work per step)."""
    from omegaconf import OmegaConf

    model_yaml.write_text(OmegaConf.to_yaml(cfg.model))
    t, o = cfg.training, cfg.optim
    if o.schedule != "cosine" or int(t.global_batch) not in (0, int(t.micro_batch) * int(cfg.launch.nproc_per_node)):
        raise SystemExit("bench/handwritten.py implements cosine schedules without gradient accumulation only")
    zero = int(cfg.strategy.zero_stage)
    return [
        f"--mode={'fsdp' if zero >= 2 else 'ddp'}",
        f"--reshard-after-forward={int(zero == 3)}",
        f"--model={model_yaml}",
        f"--steps={t.steps}",
        f"--micro-batch={t.micro_batch}",
        f"--seq-len={t.seq_len}",
        f"--lr={o.lr}",
        f"--weight-decay={o.weight_decay}",
        f"--beta1={o.beta1}",
        f"--beta2={o.beta2}",
        f"--eps={o.eps}",
        f"--warmup={o.warmup_steps}",
        f"--min-lr-ratio={o.min_lr_ratio}",
        f"--grad-clip={t.grad_clip}",
        f"--dtype={cfg.precision.param_dtype}",
        f"--log-every={t.log_every}",
        *(["--compile"] if t.compile else []),
        "--broadcast-buffers=0",  # dtlaunch's DDP does not re-broadcast the (constant) RoPE buffers
    ]


class FirstLine:
    """Polls a file from another thread and notes when its first complete line appears."""

    def __init__(self, path: Path, t0: float, period: float = 0.005) -> None:
        self.path, self.t0, self.period = path, t0, period
        self.seen: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                with self.path.open("rb") as f:
                    if b"\n" in f.read(65536):
                        self.seen = time.perf_counter() - self.t0
                        return
            except OSError:
                pass
            time.sleep(self.period)

    def stop(self) -> Optional[float]:
        self._stop.set()
        self._thread.join()
        return self.seen


def steady_tokens_per_s(lines: list[dict], tokens_per_step: int, warmup: int) -> Optional[float]:
    """Tokens/s between the end of step `warmup` and the end of the last step, from `elapsed_s`."""
    by_step = {int(r["step"]): float(r["elapsed_s"]) for r in lines if "step" in r and "elapsed_s" in r}
    if not by_step or warmup not in by_step:
        return None
    last = max(by_step)
    dt = by_step[last] - by_step[warmup]
    return tokens_per_step * (last - warmup) / dt if dt > 0 else None


def median_step_s(lines: list[dict], warmup: int) -> Optional[float]:
    """Median of the per-step differences of `elapsed_s` after step `warmup` (the per-step view of the
    same whole-loop clock: a slow outlier step moves the mean, not this)."""
    by_step = {int(r["step"]): float(r["elapsed_s"]) for r in lines if "step" in r and "elapsed_s" in r}
    gaps = [by_step[s] - by_step[s - 1] for s in sorted(by_step) if s > warmup and s - 1 in by_step]
    return statistics.median(gaps) if gaps else None


def run_one(
    side: str,
    cmd: list[str],
    env: dict[str, str],
    metrics: Path,
    log: Path,
    tokens_per_step: int,
    warmup: int,
    timeout: Optional[float] = None,
    cwd: Path = ROOT,
) -> RunResult:
    """Start `cmd`, time its first metrics line and its exit, then read its steady-state throughput.
    Past `timeout` seconds the run is stopped (see `wait_or_stop`) and reported as timed out."""
    full_env = dict(os.environ, **env)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    watch = FirstLine(metrics, t0)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        timed_out = wait_or_stop(proc, timeout)
    wall = time.perf_counter() - t0
    first = watch.stop()
    lines = read_metrics(metrics)
    result = RunResult(side, None, first, wall, command_line(cmd, env), steps_seen=len(lines), load=load)
    if timed_out:
        result.error = f"timed out after {timeout:.0f} s (stopped; {len(lines)} steps logged)"
        return result
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        result.error = f"exit {proc.returncode}: {' '.join(tail)[:300]}"
        return result
    result.tokens_per_s = steady_tokens_per_s(lines, tokens_per_step, warmup)
    result.step_s = median_step_s(lines, warmup)
    if result.tokens_per_s is None:
        result.error = f"no steady-state window in {metrics} ({len(lines)} lines)"
    return result


def wait_or_stop(proc: subprocess.Popen, timeout: Optional[float], grace: float = 45.0) -> bool:
    """Wait for `proc`; True if it outlived `timeout`. Then SIGTERM first: dtlaunch and torchrun stop
    their workers on it (torchrun starts them in sessions of their own, which a SIGKILL of the parent
    would leave running and holding the GPU); SIGKILL only after `grace` seconds."""
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return True


def run_case_pair(
    case: Case, steps: int, warmup: int, rep: int, work: Path, baseline: Optional[Path] = None
) -> list[RunResult]:
    """One dtlaunch run and one hand-written run of `case` (and one of `baseline`'s dtlaunch), in an order
    that changes with `rep` (flips for two sides, rotates for three)."""
    threads = max(1, usable_cores() // case.nproc)
    overrides = job_overrides(case, steps, threads)
    cfg = composed(overrides)
    tokens_per_step = int(cfg.training.micro_batch) * case.nproc * int(cfg.training.seq_len)
    tag = case.tag(rep)
    dt_dir, hw_dir = work / f"dt-{tag}", work / f"hw-{tag}"
    hw_dir.mkdir(parents=True, exist_ok=True)
    dt_cmd = [venv_bin("dtlaunch"), "train", *overrides, f"run.dir={dt_dir}"]
    hw_cmd = [
        venv_bin("torchrun"),
        "--standalone",
        f"--nproc-per-node={case.nproc}",
        str(ROOT / "bench" / "handwritten.py"),
        *handwritten_args(cfg, hw_dir / "model.yaml"),
        f"--metrics-file={hw_dir / 'metrics.jsonl'}",
    ]
    plain = {"DTLAUNCH_PROGRESS": "plain"}
    sides = [
        ("dtlaunch", dt_cmd, plain, dt_dir / "metrics.jsonl", work / f"dt-{tag}.log"),
        ("handwritten", hw_cmd, {"OMP_NUM_THREADS": str(threads)}, hw_dir / "metrics.jsonl", hw_dir / "out.log"),
    ]
    cwds = [ROOT, ROOT]
    if baseline is not None:
        bl_dir = work / f"bl-{tag}"
        bl_env = {**plain, "PYTHONPATH": os.pathsep.join(filter(None, [str(baseline), os.environ.get("PYTHONPATH")]))}
        bl_cmd = [venv_bin("dtlaunch"), "train", *overrides, f"run.dir={bl_dir}"]
        sides.append(("baseline", bl_cmd, bl_env, bl_dir / "metrics.jsonl", work / f"bl-{tag}.log"))
        cwds.append(baseline)
        order = [(i + rep) % 3 for i in range(3)]
    else:
        order = [1, 0] if rep % 2 else [0, 1]
    return [run_one(*sides[i], tokens_per_step=tokens_per_step, warmup=warmup, cwd=cwds[i]) for i in order]


def run(
    cases: Sequence[Case] = CASES,
    reps: int = 4,
    steps: int = 200,
    warmup: int = 10,
    keep: Optional[Path] = None,
    baseline: Optional[Path] = None,
) -> list[CaseResult]:
    work = Path(tempfile.mkdtemp(prefix="dtlaunch-bench-tps-")) if keep is None else keep
    results = [CaseResult(c) for c in cases]
    try:
        for rep in range(reps):
            for res in results:
                pair = run_case_pair(res.case, steps, warmup, rep, work, baseline)
                res.runs.extend(pair)
                for r in pair:
                    status = r.error or (
                        f"{r.tokens_per_s:,.0f} tok/s, step {1e3 * (r.step_s or 0):.2f} ms, "
                        f"first step {r.first_step_s:.2f} s, load {r.load:.2f}"
                    )
                    print(f"  [{rep + 1}/{reps}] {res.case.label:40s} {r.side:12s} {status}", flush=True)
                print(f"  [{rep + 1}/{reps}] {res.case.label:40s} paired: {_paired_line(pair)}", flush=True)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return results


def paired_ratios(runs: Sequence[RunResult], side: str = "dtlaunch") -> dict[str, list[float]]:
    """Per repetition (runs in the order they ran, one of each side per repetition): `side`'s per-step
    ratio (hand-written / its median step) and whole-loop ratio (its tokens/s / hand-written's)."""
    mine = [r for r in runs if r.side == side]
    hand = [r for r in runs if r.side == "handwritten"]
    out: dict[str, list[float]] = {"per_step": [], "whole_loop": []}
    if not mine:  # a side this run did not have (no --baseline)
        return out
    for a, h in zip(mine, hand, strict=True):  # one of each side per repetition
        if a.error or h.error:
            continue
        if a.step_s and h.step_s:
            out["per_step"].append(h.step_s / a.step_s)
        if a.tokens_per_s and h.tokens_per_s:
            out["whole_loop"].append(a.tokens_per_s / h.tokens_per_s)
    return out


def _paired_line(pair: Sequence[RunResult]) -> str:
    parts = []
    for side in ("dtlaunch", "baseline"):
        p = paired_ratios(pair, side)
        if p["per_step"] or p["whole_loop"]:
            step = f"{p['per_step'][0]:.3f}" if p["per_step"] else "-"
            loop = f"{p['whole_loop'][0]:.3f}" if p["whole_loop"] else "-"
            parts.append(f"{side} per-step {step}, whole-loop {loop}")
    return "; ".join(parts) or "-"


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """JSON-able summary: per case, stats of each side and the ratio of medians."""
    out = []
    for res in results:
        dt = stats(r.tokens_per_s for r in res.of("dtlaunch"))
        hw = stats(r.tokens_per_s for r in res.of("handwritten"))
        ratio = dt["median"] / hw["median"] if dt["n"] and hw["n"] else None
        dt_step = stats(r.step_s for r in res.of("dtlaunch") if r.step_s)
        hw_step = stats(r.step_s for r in res.of("handwritten") if r.step_s)
        step_ratio = hw_step["median"] / dt_step["median"] if dt_step["n"] and hw_step["n"] else None
        out.append(
            {
                "case": res.case.label,
                "dtlaunch_tokens_per_s": dt,
                "handwritten_tokens_per_s": hw,
                "ratio": ratio,
                "dtlaunch_step_s": dt_step,
                "handwritten_step_s": hw_step,
                "per_step_ratio": step_ratio,
                "paired": {
                    side: {
                        **p,
                        "median_per_step": _median(p["per_step"]),
                        "median_whole_loop": _median(p["whole_loop"]),
                    }
                    for side in ("dtlaunch", "baseline")
                    if (p := paired_ratios(res.runs, side))["per_step"] or p["whole_loop"]
                },
                "loads": [r.load for r in res.runs],
                "dtlaunch_first_step_s": stats(r.first_step_s for r in res.of("dtlaunch") if r.first_step_s),
                "handwritten_first_step_s": stats(r.first_step_s for r in res.of("handwritten") if r.first_step_s),
                "commands": {side: next((r.command for r in res.runs if r.side == side), "") for side in _SIDES},
                "errors": [f"{r.side}: {r.error}" for r in res.runs if r.error],
                "runs": [r.__dict__ for r in res.runs],
            }
        )
    return {"cases": out}


_SIDES = ("dtlaunch", "handwritten", "baseline")


def table(summary: dict[str, Any]) -> str:
    rows = []
    for c in summary["cases"]:
        ratio = c["ratio"]
        rows.append(
            [
                c["case"],
                min_med_max(c["dtlaunch_tokens_per_s"], digits=0),
                min_med_max(c["handwritten_tokens_per_s"], digits=0),
                f"{ratio:.3f}" if ratio else "-",
                f"{c.get('per_step_ratio'):.3f}" if c.get("per_step_ratio") else "-",
                "yes" if ratio and ratio >= 0.98 else "no",
                c["dtlaunch_tokens_per_s"]["n"],
            ]
        )
    return markdown_table(_HEADERS, rows)


_HEADERS = [
    "case",
    "dtlaunch tok/s, median (min–max)",
    "hand-written tok/s",
    "whole-loop ratio",
    "per-step ratio",
    "≥ 0.98",
    "reps",
]


def paired_table(summary: dict[str, Any]) -> str:
    """Per case and side (dtlaunch, and --baseline's): each repetition's paired per-step and whole-loop
    ratios against the hand-written run next to it, their medians, and the load averages at the starts."""
    rows = []
    for c in summary["cases"]:
        loads = [x for x in c.get("loads", []) if x is not None]
        for side, p in c.get("paired", {}).items():
            rows.append(
                [
                    c["case"],
                    side,
                    ", ".join(f"{x:.3f}" for x in p["per_step"]),
                    f"{p['median_per_step']:.3f}" if p["median_per_step"] else "-",
                    ", ".join(f"{x:.3f}" for x in p["whole_loop"]),
                    f"{p['median_whole_loop']:.3f}" if p["median_whole_loop"] else "-",
                    f"{min(loads):.1f}–{max(loads):.1f}" if loads else "-",
                ]
            )
    headers = ["case", "side", "per-step ratios", "median", "whole-loop ratios", "median", "load"]
    return markdown_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repetitions of 60 steps")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--keep", default="", help="keep the run directories here")
    ap.add_argument("--json", default="", help="write the summary here")
    ap.add_argument("--cases", default="", help="indices into CASES, e.g. 1,3 (default: all)")
    ap.add_argument("--race", action="store_true", help="issue #49's race: DDP x2 tiny and model=small, 3 repetitions")
    ap.add_argument("--baseline", default="", help="also race `dtlaunch train` from this checkout (a third side)")
    args = ap.parse_args()
    reps, steps = (2, 60) if args.quick else (args.reps, args.steps)
    if args.race and "--reps" not in sys.argv:
        reps = 3
    keep = Path(args.keep) if args.keep else None
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(RACE_CASES if args.race else CASES)
    baseline = Path(args.baseline).resolve() if args.baseline else None
    if baseline is not None and not (baseline / "dtlaunch" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {baseline}: no dtlaunch package there (give a checkout's root)")
    summary = summarize(run(cases, reps=reps, steps=steps, warmup=args.warmup, keep=keep, baseline=baseline))
    summary["baseline"] = str(baseline) if baseline is not None else None
    print(table(summary))
    print()
    print(paired_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
