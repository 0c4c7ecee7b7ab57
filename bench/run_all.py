"""`make bench`: the CPU benchmark suite (<= 15 minutes on a 2-core machine).

Runs, in order: throughput parity (dtlaunch vs hand-written, alternating A/B), the per-step overhead
profile, launch/plan timings, planner accuracy (bench/planner_accuracy.py --real, time-capped) and the
checkpoint benchmark (bench/checkpoint_bench.py). Writes bench/results/cpu-<date>.md and .json and
updates the summary table in bench/results/LATEST.md and bench/README.md. --quick is for development:
fewer repetitions and subsets, results named cpu-quick-<date>.* and LATEST left alone.

    python bench/run_all.py [--quick] [--only throughput,launch,overhead,planner,checkpoint]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import launch_overhead, throughput
from bench.common import (
    BENCH,
    RESULTS,
    ROOT,
    command_line,
    describe_machine,
    machine_info,
    markdown_table,
    this_command,
    venv_bin,
    write_json,
)

SECTIONS = ("throughput", "overhead", "launch", "planner", "checkpoint")
README_BEGIN, README_END = "<!-- latest-results:begin -->", "<!-- latest-results:end -->"


def run_script(cmd: list[str], timeout: float, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run another benchmark script; keep its output even when it times out (partial tables count)."""
    import os

    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {}))
        )
        out, rc, timed_out = done.stdout, done.returncode, False
        err = done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, rc, timed_out = "", None, True
    return {
        "command": command_line(cmd),  # portable: checkout paths relative, the venv's programs by name
        "returncode": rc,
        "timed_out": timed_out,
        "wall_s": time.perf_counter() - t0,
        "stdout": out,
        "stderr_tail": "\n".join(err.strip().splitlines()[-5:]) if err else "",
    }


# ------------------------------------------------------------------------------------------ sections


def section_overhead(quick: bool) -> dict[str, Any]:
    outer = "6" if quick else "15"
    runs = {}
    for world in (1,) if quick else (1, 2):
        script = str(BENCH / "step_overhead.py")
        cmd = (
            [sys.executable, script, "--outer", outer]
            if world == 1
            else [venv_bin("torchrun"), "--standalone", "--nproc-per-node=2", script, "--outer", outer]
        )
        res = run_script(cmd, timeout=240, env={"OMP_NUM_THREADS": "1"})
        match = re.search(r"^\{.*^\}", res["stdout"], re.S | re.M)
        res["profile"] = json.loads(match.group(0)) if match else None
        runs[f"world {world}"] = res
    return runs


def section_planner(quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH / "planner_accuracy.py"), "--real"]
    if quick:
        cmd += ["--only", "0,1"]
    res = run_script(cmd, timeout=120 if quick else 270)
    errs = [float(m) for m in re.findall(r"([+-]\d+\.\d+) %\s*$", res["stdout"], re.M)]
    res["rows"] = len(errs)
    res["median_abs_error_pct"] = statistics.median(abs(e) for e in errs) if errs else None
    res["max_abs_error_pct"] = max(abs(e) for e in errs) if errs else None
    return res


def section_checkpoint(quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH / "checkpoint_bench.py"), "--repeats", "1" if quick else "3"]
    res = run_script(cmd, timeout=200 if quick else 300)
    out = res["stdout"]

    def num(pattern: str) -> Optional[float]:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else None

    res["sync_save_s"] = num(r"sync save\s+([\d.]+) s")
    res["async_blocking_s"] = num(r"async save, blocking\s+([\d.]+) s")
    res["async_total_s"] = num(r"total until written ([\d.]+) s")
    res["load_s"] = num(r"load \(resume\)\s+([\d.]+) s")
    res["mib"] = num(r"([\d.]+) MiB per checkpoint")
    res["params"] = (re.search(r"model (\S+) params", out) or [None, None])[1]
    return res


# ------------------------------------------------------------------------------------------ report


def summary_rows(r: dict[str, Any]) -> list[list[Any]]:
    """(benchmark, result, goal, met) — the table LATEST.md and the README show."""
    rows: list[list[Any]] = []
    for c in r.get("throughput", {}).get("cases", []):
        ratio = c["ratio"]
        rows.append(
            [
                f"throughput, {c['case']}: dtlaunch / hand-written (median tok/s)",
                f"{ratio:.3f} ({c['dtlaunch_tokens_per_s']['median']:,.0f} / "
                f"{c['handwritten_tokens_per_s']['median']:,.0f})"
                if ratio
                else "-",
                "≥ 0.98",
                "yes" if ratio and ratio >= 0.98 else "no",
            ]
        )
    for f in r.get("first_step", []):
        rows.append(
            [
                f"time to first step, {f['case']}: dtlaunch − hand-written",
                f"{f['extra_s']:+.2f} s ({f['dtlaunch']['median']:.2f} vs {f['handwritten']['median']:.2f})"
                if f["extra_s"] is not None
                else "-",
                "≤ +1 s",
                "yes" if f["extra_s"] is not None and f["extra_s"] <= 1.0 else "no",
            ]
        )
    for c in r.get("launch", []):
        if c["goal_s"] is None:
            continue
        med = c["seconds"]["median"]
        # A one-process command's CPU time is what it takes on a quiet machine, give or take its I/O; the
        # wall time grows with whatever else loads the machine: the goal is judged on the CPU time if known.
        cpu = c.get("cpu_seconds", {}).get("median")
        judged = cpu or med
        rows.append(
            [
                c["name"],
                (f"{med:.2f} s" + (f" (CPU {cpu:.2f} s)" if cpu else "")) if med else c["error"],
                f"< {c['goal_s']} s" + (" CPU" if cpu else ""),
                "yes" if judged and judged < c["goal_s"] else "no",
            ]
        )
    p = r.get("planner")
    if p:
        ok = p["median_abs_error_pct"] is not None
        rows.append(
            [
                f"planner accuracy ({p['rows']} real runs{', time-capped' if p['timed_out'] else ''})",
                f"median |err| {p['median_abs_error_pct']:.2f} %, max {p['max_abs_error_pct']:.2f} %" if ok else "-",
                "≤ 3 %, ≤ 8 %",
                "yes" if ok and p["median_abs_error_pct"] <= 3 and p["max_abs_error_pct"] <= 8 else "no",
            ]
        )
    k = r.get("checkpoint")
    if k:
        ok = k["sync_save_s"] and k["async_blocking_s"] is not None
        rows.append(
            [
                f"checkpoint ({k['params']} params, 2 ranks): async blocking / sync save",
                f"{k['async_blocking_s'] / k['sync_save_s']:.1%} ({k['async_blocking_s']:.2f} / {k['sync_save_s']:.2f} s); "
                f"load {k['load_s']:.2f} s; {k['mib']:.0f} MiB"
                if ok
                else "-",
                "< 10 %",
                "yes" if ok and k["async_blocking_s"] / k["sync_save_s"] < 0.10 else "no",
            ]
        )
    return rows


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    parts = [
        f"# dtlaunch CPU benchmarks, {m['date']}",
        "",
        f"- machine: {describe_machine(m)}",
        f"- command: `{r['command']}` ({'quick' if r['quick'] else 'full' if all(k in r for k in SECTIONS) else 'partial'}"
        f" suite, {r['wall_s']:.0f} s)",
        "- every figure: median over repetitions, (min–max) where shown; A/B runs alternate.",
        "",
        "## Summary",
        "",
        markdown_table(["benchmark", "result", "goal", "met"], summary_rows(r)),
    ]
    if "throughput" in r:
        t = r["throughput"]
        parts += ["", "## Throughput parity (steady-state tokens/s)", "", throughput.table(t), ""]
        for c in t["cases"]:
            parts += [f"- {c['case']}:", f"  - dtlaunch: `{c['commands']['dtlaunch']}`"]
            parts += [f"  - hand-written: `{c['commands']['handwritten']}`"]
            parts += [f"  - error: {e}" for e in c["errors"]]
    if "overhead" in r:
        parts += ["", "## Per-step overhead profile (µs per call, minimum over repetitions)", ""]
        for name, res in r["overhead"].items():
            prof = res.get("profile")
            if not prof:
                parts += [f"- {name}: no profile (exit {res['returncode']}): {res['stderr_tail']}"]
                continue
            parts += [
                f"{name}, {prof['recipe']}, {prof['threads']} thread(s), clock: {prof['clock']}; `{res['command']}`",
                "",
            ]
            parts += [markdown_table(["piece", "µs"], [[k, f"{v:,.1f}"] for k, v in prof["us"].items()]), ""]
    if "launch" in r:
        parts += ["", "## Launch and plan times (whole process)", ""]
        parts += [launch_overhead.table(r["launch"], r.get("first_step", [])), ""]
        parts += [f"- `{c['command']}`" for c in r["launch"]]
    for key, title in (("planner", "Planner accuracy"), ("checkpoint", "Checkpoints")):
        if key in r:
            res = r[key]
            state = "timed out (partial)" if res["timed_out"] else f"exit {res['returncode']}"
            parts += ["", f"## {title}", "", f"`{res['command']}` — {state}, {res['wall_s']:.0f} s", "", "```"]
            parts += [res["stdout"].strip() or res["stderr_tail"], "```"]
    return "\n".join(parts) + "\n"


def merged_with_latest(r: dict[str, Any], only: list[str], md_name: str) -> Optional[tuple[dict[str, Any], str, str]]:
    """A partial run (--only) laid over the full run the summary shows: (the results with this run's
    sections in place of that run's, that run's file name, a note naming what was re-run where), or None
    when there is no full run to lay it over."""
    latest = RESULTS / "LATEST.md"
    found = re.search(r"full file: \[(cpu-\d{4}-\d{2}-\d{2})\.md\]", latest.read_text()) if latest.exists() else None
    if found is None or not (RESULTS / f"{found.group(1)}.json").exists():
        return None
    base = json.loads((RESULTS / f"{found.group(1)}.json").read_text())
    rerun = [k for k in (*SECTIONS, "first_step") if k in r]
    merged = {**base, **{k: r[k] for k in rerun}}
    note = (
        f"; re-run since ({', '.join(only)}; {r['machine']['date']}; {describe_machine(r['machine'])}): "
        f"[{md_name}](results/{md_name})"
    )
    return merged, f"{found.group(1)}.md", note


def other_sections(latest: str) -> str:
    """What LATEST.md holds after the CPU summary (the GPU section that bench/gpu writes): kept as it is."""
    found = re.search(r"^## ", latest, flags=re.MULTILINE)
    return "\n" + latest[found.start() :] if found else ""


def update_latest(r: dict[str, Any], md_name: str, note: str = "") -> None:
    table = markdown_table(["benchmark", "result", "goal", "met"], summary_rows(r))
    header = f"Latest CPU results ({r['machine']['date']}; {describe_machine(r['machine'])}); full file: "
    block = f"{header}[{md_name}](results/{md_name}){note}\n\n{table}\n"
    latest = RESULTS / "LATEST.md"
    (RESULTS / "LATEST.md").write_text(
        f"# Latest benchmark results\n\n{block.replace('(results/', '(')}\nReproduce: `make bench` "
        f"(`{r['command']}`).\n{other_sections(latest.read_text() if latest.exists() else '')}"
    )
    readme = BENCH / "README.md"
    if readme.exists():
        text = readme.read_text()
        if README_BEGIN in text and README_END in text:
            head, rest = text.split(README_BEGIN, 1)
            _, tail = rest.split(README_END, 1)
            readme.write_text(f"{head}{README_BEGIN}\n{block}{README_END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="development: fewer repetitions, no LATEST update")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        sys.exit(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    t0 = time.perf_counter()
    r: dict[str, Any] = {"machine": machine_info(), "command": this_command(), "quick": args.quick}
    print(describe_machine(r["machine"]), flush=True)

    def stage(name: str) -> bool:
        if name in only:
            print(f"== {name} ({time.perf_counter() - t0:.0f} s elapsed)", flush=True)
        return name in only

    if stage("throughput"):
        reps, steps = (2, 60) if args.quick else (4, 200)
        r["throughput"] = throughput.summarize(throughput.run(reps=reps, steps=steps))
        r["first_step"] = launch_overhead.first_step_rows(r["throughput"])
    if stage("overhead"):
        r["overhead"] = section_overhead(args.quick)
    if stage("launch"):
        r["launch"] = launch_overhead.run(reps=2 if args.quick else 5)
    if stage("planner"):
        r["planner"] = section_planner(args.quick)
    if stage("checkpoint"):
        r["checkpoint"] = section_checkpoint(args.quick)
    r["wall_s"] = time.perf_counter() - t0

    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = f"cpu-quick-{day}" if args.quick else f"cpu-{day}"
    if not args.quick and set(only) != set(SECTIONS):
        # A subset re-run is named for its sections: on the day of a full run it must not replace that run's
        # files, which the summary keeps pointing to for the other rows.
        stem += "-" + "-".join(s for s in SECTIONS if s in only)
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = render(r)
    (RESULTS / f"{stem}.md").write_text(md)
    write_json(RESULTS / f"{stem}.json", r)
    if not args.quick and set(only) == set(SECTIONS):
        update_latest(r, f"{stem}.md")
    elif not args.quick:  # a subset re-run: its rows replace those of the full run the summary shows
        merged = merged_with_latest(r, only, f"{stem}.md")
        if merged is not None:
            update_latest(*merged)
    print(md)
    print(f"wrote {RESULTS / stem}.md and .json in {r['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
