"""Throughput parity under the same noise: dtlaunch and the hand-written loop run at once, taking turns.

bench/throughput.py alternates whole runs: each side's steady state lasts a few seconds, and on a shared
machine the speed of the cores drifts by 20-30 % over tens of seconds (measured: the same 1,000-step
run took 14.7 s and 20.0 s two minutes apart). A ratio of two runs then measures the drift as much as the
loops. Here both jobs are started together and take turns in short slices: while one side runs, every
process of the other (launcher, torchrun agent, workers) is stopped with SIGSTOP, so one side computes at a
time and each slice of one side sits between two slices of the other, a few seconds apart.

Each side's step times come from its own metrics (`elapsed_s` at the end of every step, a monotonic
clock). A step during which its side was stopped is dropped (its gap spans the other side's slice, many
times a step). Of the rest: the per-step ratio compares medians (hand-written / dtlaunch), the whole-loop
ratio means (every step's full time, data, metrics and logging included, with its outliers). A
repetition is one race of `--slices` turns each; the sides' order flips every repetition.

    python bench/throughput_sliced.py                 # issue #49's race: DDP x2 tiny and model=small
    python bench/throughput_sliced.py --cases 0 --reps 3 --slices 8 --slice-s 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, command_line, markdown_table, usable_cores, venv_bin
from bench.throughput import CASES, RACE_CASES, Case, composed, handwritten_args, job_overrides
from dtlaunch.run.metrics_file import read_metrics


def descendants(root: int) -> list[int]:
    """`root` and every process below it (Linux /proc), parents before children. torchrun starts its
    workers in sessions of their own, so a process group would miss them; the parent links do not."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ")"
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def signal_tree(root: int, sig: int) -> None:
    for pid in descendants(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Side:
    name: str
    cmd: list[str]
    env: dict[str, str]
    metrics: Path
    log: Path
    proc: Optional[subprocess.Popen] = None
    slices: list[tuple[int, int]] = field(default_factory=list)  # (steps logged before, after) each turn

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=dict(os.environ, **self.env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def steps(self) -> dict[int, float]:
        return {int(r["step"]): float(r["elapsed_s"]) for r in read_metrics(self.metrics) if "elapsed_s" in r}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        signal_tree(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.resume()
        if self.alive():
            self.proc.terminate()  # dtlaunch and torchrun stop their workers on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                signal_tree(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_for_steps(side: Side, n: int, timeout: float) -> None:
    """Until `side` has logged `n` steps (the warm-up), or fail with its log's last line."""
    end = time.monotonic() + timeout
    while len(side.steps()) < n:
        if not side.alive() or time.monotonic() > end:
            tail = side.log.read_text().strip().splitlines()[-1:] if side.log.exists() else []
            raise SystemExit(f"{side.name} did not reach step {n}: {' '.join(tail)[:300]}")
        time.sleep(0.05)


def step_gaps(times: dict[int, float], first: int, slice_s: float) -> list[float]:
    """Each step's time after step `first`, the steps during which their side was stopped left out: a gap
    longer than half a slice, or than 8 median steps (a step cut by a stop spans the other side's slice)."""
    gaps = [times[s] - times[s - 1] for s in sorted(times) if s > first and s - 1 in times]
    cap = min(slice_s / 2, 8 * statistics.median(gaps)) if gaps else 0.0
    return [g for g in gaps if g < cap]


@dataclass
class Race:
    case: str
    per_step: float  # hand-written median step / dtlaunch median step
    whole_loop: float  # hand-written mean step / dtlaunch mean step
    steps: dict[str, int]  # steps counted per side
    median_ms: dict[str, float]
    mean_ms: dict[str, float]
    commands: dict[str, str]


def race(
    case: Case, rep: int, slices: int, slice_s: float, warmup: int, work: Path, versus: Sequence[str] = ()
) -> Race:
    """Both sides of `case` started together; after the warm-up they take `slices` turns each of
    `slice_s` seconds, the other side stopped meanwhile. With `versus` (dtlaunch overrides) the other side
    is `dtlaunch train` with those overrides added instead of the hand-written loop (an A/B of a setting
    under the same noise); it keeps the name "handwritten" in the results."""
    threads = max(1, usable_cores() // case.nproc)
    overrides = job_overrides(case, 10**6, threads)  # stopped by the harness, not by a step count
    tag = case.tag(rep)
    dt_dir = work / f"dt-{tag}"
    if versus:
        b_dir = work / f"b-{tag}"
        b_cmd = [venv_bin("dtlaunch"), "train", *overrides, *versus, f"run.dir={b_dir}"]
        other = Side(
            "handwritten", b_cmd, {"DTLAUNCH_PROGRESS": "plain"}, b_dir / "metrics.jsonl", work / f"b-{tag}.log"
        )
    else:
        hw_dir = work / f"hw-{tag}"
        hw_dir.mkdir(parents=True, exist_ok=True)
        hw_cmd = [
            venv_bin("torchrun"),
            "--standalone",
            f"--nproc-per-node={case.nproc}",
            str(ROOT / "bench" / "handwritten.py"),
            *handwritten_args(composed(overrides), hw_dir / "model.yaml"),
            f"--metrics-file={hw_dir / 'metrics.jsonl'}",
        ]
        other = Side(
            "handwritten", hw_cmd, {"OMP_NUM_THREADS": str(threads)}, hw_dir / "metrics.jsonl", hw_dir / "out.log"
        )
    sides = [
        Side(
            "dtlaunch",
            [venv_bin("dtlaunch"), "train", *overrides, f"run.dir={dt_dir}"],
            {"DTLAUNCH_PROGRESS": "plain"},
            dt_dir / "metrics.jsonl",
            work / f"dt-{tag}.log",
        ),
        other,
    ]
    order = sides if rep % 2 == 0 else sides[::-1]
    try:
        # Start-ups one after the other (each warm-up alone), then the first side waits stopped.
        for side in order:
            side.start()
            wait_for_steps(side, warmup, timeout=300)
            side.pause()
        firsts = {s.name: max(s.steps()) for s in sides}
        for _ in range(slices):
            for side in order:
                side.resume()
                time.sleep(slice_s)
                side.pause()
                if not side.alive():
                    raise SystemExit(f"{side.name} exited during the race: see {side.log}")
    finally:
        for side in sides:
            side.stop()
    gaps = {s.name: step_gaps(s.steps(), firsts[s.name], slice_s) for s in sides}
    med = {k: statistics.median(v) for k, v in gaps.items()}
    mean = {k: statistics.fmean(v) for k, v in gaps.items()}
    return Race(
        case.label,
        per_step=med["handwritten"] / med["dtlaunch"],
        whole_loop=mean["handwritten"] / mean["dtlaunch"],
        steps={k: len(v) for k, v in gaps.items()},
        median_ms={k: 1e3 * v for k, v in med.items()},
        mean_ms={k: 1e3 * v for k, v in mean.items()},
        commands={s.name: command_line(s.cmd, s.env) for s in sides},
    )


def table(races: Sequence[Race]) -> str:
    by_case: dict[str, list[Race]] = {}
    for r in races:
        by_case.setdefault(r.case, []).append(r)
    rows = []
    for case, rs in by_case.items():
        step = [r.per_step for r in rs]
        loop = [r.whole_loop for r in rs]
        rows.append(
            [
                case,
                ", ".join(f"{x:.3f}" for x in step),
                f"{statistics.median(step):.3f}",
                ", ".join(f"{x:.3f}" for x in loop),
                f"{statistics.median(loop):.3f}",
                "yes" if min(statistics.median(step), statistics.median(loop)) >= 0.98 else "no",
                " / ".join(f"{r.median_ms['dtlaunch']:.1f}:{r.median_ms['handwritten']:.1f}" for r in rs),
                sum(r.steps["dtlaunch"] for r in rs),
            ]
        )
    headers = [
        "case",
        "per-step ratios",
        "median",
        "whole-loop ratios",
        "median",
        "≥ 0.98",
        "median step ms, dtlaunch:hand-written",
        "dtlaunch steps counted",
    ]
    return markdown_table(headers, rows)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="indices into bench/throughput.py's CASES (default: the race's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slices", type=int, default=8, help="turns per side in one repetition")
    ap.add_argument(
        "--slice-s", type=float, default=3.0, help="seconds per turn (many steps: a stopped step is dropped)"
    )
    ap.add_argument("--warmup", type=int, default=10, help="steps each side runs alone before the race")
    ap.add_argument("--json", default="", help="write every repetition here")
    ap.add_argument("--keep", default="", help="keep the run directories here")
    ap.add_argument("--dt", nargs="*", default=[], help="extra overrides for the dtlaunch side")
    ap.add_argument(
        "--versus",
        nargs="*",
        default=[],
        help="race dtlaunch with these overrides added instead of the hand-written loop",
    )
    args = ap.parse_args(argv)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(RACE_CASES)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dtlaunch-bench-sliced-"))
    races = []
    for rep in range(args.reps):
        for case in cases:
            r = race(
                Case(case.recipe, case.nproc, (*case.extra, *args.dt)),
                rep,
                args.slices,
                args.slice_s,
                args.warmup,
                work,
                args.versus,
            )
            races.append(r)
            print(
                f"  [{rep + 1}/{args.reps}] {case.label:42s} per-step {r.per_step:.3f} whole-loop {r.whole_loop:.3f}"
                f" (median ms dtlaunch {r.median_ms['dtlaunch']:.2f}, hand-written {r.median_ms['handwritten']:.2f};"
                f" {r.steps['dtlaunch']} / {r.steps['handwritten']} steps)",
                flush=True,
            )
    print(table(races))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in races], indent=2) + "\n")


if __name__ == "__main__":
    main()
