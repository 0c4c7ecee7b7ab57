"""Where the start of `dtlaunch train recipe=tiny_ddp training.steps=1` goes, phase by phase.

Each repetition runs the command as a fresh process into a new run directory and times, on the wall clock
(time.time(), comparable across processes):

- the launcher's phase lines on its stdout, as they arrive here ("[dtlaunch] composing the job", "planning
  memory", "starting N worker(s)");
- the workers' `startup: <what> at <epoch>` lines in RUN/logs/rank0.log (dtlaunch.run.phases.startup_stamp):
  worker started, imports done, process group joined, mesh and model built, loop started, training finished;
- step 1's line in RUN/metrics.jsonl (its `time`), and the command's exit.

Phases (each the time from the previous mark): CLI start (Python, the CLI's imports, up to "composing"),
compose, plan + run directory (+ the launcher's torch-agent import it overlaps), torchrun start (up to rank
0's first Python line), worker imports, process group, mesh + model build, loaders + checkpoint + metrics
set-up, first step (to its metrics line), the worker's end (final checkpoint, summary.json, loss.png,
trackers) and the rest (process group teardown, torchrun, the launcher's summary, interpreter exit). The
machine is shared and noisy: medians over the repetitions are reported, with min and max.

    python bench/launch_time.py [--reps 3] [--json FILE] [-- extra overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

COMMAND = ["train", "recipe=tiny_ddp", "training.steps=1"]

# (phase name, the mark that ends it); marks are read from the launcher's stdout, rank 0's log, metrics.
PHASES = [
    ("CLI start (python, CLI imports)", "composing"),
    ("compose", "planning"),
    ("plan, run dir (+ agent import)", "starting workers"),
    ("torchrun start", "worker started"),
    ("worker imports", "worker imports done"),
    ("process group", "process group joined"),
    ("mesh + model build", "mesh and model built"),
    ("loaders, checkpoint, metrics", "loop started"),
    ("first step", "first step"),
    ("final checkpoint, summary, plot", "training finished"),
    ("teardown, launcher summary, exit", "exit"),
]
STDOUT_MARKS = {
    "[dtlaunch] composing the job": "composing",
    "[dtlaunch] planning memory": "planning",
    "[dtlaunch] starting": "starting workers",
}
STAMP = re.compile(r"startup: (.+?) at (\d+\.\d+)")


def dtlaunch_cmd() -> list[str]:
    """`python -m dtlaunch`, which runs what the console script runs (cli.console_main) from the checkout
    on sys.path, even where an editable install's script predates a change of its entry point."""
    return [sys.executable, "-m", "dtlaunch"]


def one_run(extra: list[str], timeout: float = 600) -> dict[str, float]:
    """Seconds from the command's start to each mark of one run."""
    with tempfile.TemporaryDirectory(prefix="launch_time_") as tmp:
        run_dir = Path(tmp) / "run"
        env = dict(os.environ, DTLAUNCH_PROGRESS="plain", PYTHONUNBUFFERED="1")
        marks: dict[str, float] = {}
        t0 = time.time()
        proc = subprocess.Popen(
            [*dtlaunch_cmd(), *COMMAND, *extra, f"run.dir={run_dir}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        lines: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.time()
                lines.append(line)
                for prefix, mark in STDOUT_MARKS.items():
                    if line.startswith(prefix) and mark not in marks:
                        marks[mark] = now

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code = proc.wait(timeout=timeout)
        marks["exit"] = time.time()
        reader.join(timeout=10)
        if code != 0:
            raise RuntimeError(f"exit {code}:\n{''.join(lines)[-3000:]}")
        for m in STAMP.finditer((run_dir / "logs" / "rank0.log").read_text()):
            marks.setdefault(m.group(1), float(m.group(2)))
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        marks["first step"] = float(first["time"])
        return {k: v - t0 for k, v in marks.items()}


def phases(marks: dict[str, float]) -> dict[str, Optional[float]]:
    """Each phase's seconds (None where its mark or the previous one is missing)."""
    out: dict[str, Optional[float]] = {}
    previous: Optional[float] = 0.0
    for name, mark in PHASES:
        at = marks.get(mark)
        out[name] = at - previous if at is not None and previous is not None else None
        previous = at
    out["to first step"] = marks.get("first step")
    out["to exit"] = marks.get("exit")
    return out


def summarise(runs: list[dict[str, Optional[float]]]) -> list[dict[str, Any]]:
    rows = []
    for name in [n for n, _ in PHASES] + ["to first step", "to exit"]:
        values = [r[name] for r in runs if r.get(name) is not None]
        rows.append(
            {
                "phase": name,
                "median_s": statistics.median(values) if values else None,
                "min_s": min(values) if values else None,
                "max_s": max(values) if values else None,
                "n": len(values),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    out = ["| phase | median s | min–max s |", "|---|---|---|"]
    out += [f"| {r['phase']} | {f(r['median_s'])} | {f(r['min_s'])}–{f(r['max_s'])} |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="", help="Also write the runs and the summary here.")
    ap.add_argument("extra", nargs="*", help="More overrides for every run.")
    args = ap.parse_args()
    runs = []
    for i in range(args.reps):
        marks = one_run(args.extra)
        runs.append(phases(marks))
        print(
            f"run {i + 1}/{args.reps}: first step {marks['first step']:.2f} s, exit {marks['exit']:.2f} s", flush=True
        )
    rows = summarise(runs)
    load = os.getloadavg()[0]
    print(f"\n`dtlaunch {' '.join(COMMAND + args.extra)}`, {args.reps} runs, load {load:.2f} at the end")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"command": COMMAND + args.extra, "runs": runs, "summary": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
