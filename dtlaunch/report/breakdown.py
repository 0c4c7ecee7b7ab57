"""Where a profiled step's time went, per rank, read from the traces torch.profiler wrote (no torch here:
the launcher and `dtlaunch report` use it).

The step is the span of the `dtlaunch.step` annotation the worker adds around it. Inside it, every instant
is put in exactly one category, so the categories add up to the step's span:

- data: inside a `dtlaunch.data` annotation (the loader's `next_batch`), on GPU only while no kernel runs;
- compute: an operator runs on the training thread (CPU; outside the loader), or a non-communication
  kernel runs on the GPU;
- comm exposed: a collective is in flight (gloo's work on its own threads, `gloo:*` / `nccl:*` events and
  NCCL kernels) while nothing computes: the step waits for it;
- bubble: the same for point-to-point send/recv (pipeline parallelism): a stage waits for its neighbour;
- host: the rest (Python between operators, the launch of the next operator, idle time).
`comm_overlapped` is reported beside them: the part of compute during which a collective was in flight
(it is inside compute, not added to the sum).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Iterable

from dtlaunch.run.profile_files import DATA_ANNOTATION, PROFILE_DIR, STEP_ANNOTATION, SUMMARY_NAME

CATEGORIES = ("compute", "comm_exposed", "bubble", "data", "host")

_COMM_PREFIXES = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")
_P2P = re.compile(r"send|recv", re.IGNORECASE)
# Operators that only hand work to a communication backend or wait for it: not compute.
_NOT_COMPUTE = ("c10d::", "_c10d_functional::wait", "record_param_comms", "gloo:", "nccl:")

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """Points in both (each argument sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """Points of xs not in ys (each sorted and disjoint)."""
    out: list[Interval] = []
    j = 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def load_events(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file (.json or .json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _is_comm(e: dict) -> bool:
    return str(e["name"]).startswith(_COMM_PREFIXES)


def _span(e: dict) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))


def breakdown(events: list[dict]) -> dict[str, float]:
    """Seconds per category (see the module doc) of the trace's `dtlaunch.step` span, with `step_s` (the
    span) and `comm_overlapped`."""
    steps = [e for e in events if e["name"] == STEP_ANNOTATION]
    if not steps:
        raise ValueError(f"no '{STEP_ANNOTATION}' event in the trace")
    step_event = max(steps, key=lambda e: e["dur"])
    step = [_span(step_event)]
    main_tid = step_event.get("tid")
    gpu_kernels = [e for e in events if e.get("cat") == "kernel"]
    data = intersect(union(_span(e) for e in events if e["name"] == DATA_ANNOTATION), step)
    if gpu_kernels:
        compute_events = [e for e in gpu_kernels if not _is_comm(e)]
    else:
        compute_events = [
            e
            for e in events
            if e.get("cat") == "cpu_op" and e.get("tid") == main_tid and not str(e["name"]).startswith(_NOT_COMPUTE)
        ]
    compute = intersect(union(_span(e) for e in compute_events), step)
    if gpu_kernels:  # the GPU computing while the host loads the next batch: that loading costs nothing
        data = subtract(data, compute)
    else:  # one thread: the operators inside the loader's annotation are the loading
        compute = subtract(compute, data)
    comm_events = [e for e in events if _is_comm(e)]
    p2p = intersect(union(_span(e) for e in comm_events if _P2P.search(str(e["name"]))), step)
    collective = intersect(union(_span(e) for e in comm_events if not _P2P.search(str(e["name"]))), step)
    busy = union(compute + data)
    bubble = subtract(p2p, busy)
    exposed = subtract(subtract(collective, busy), bubble)
    seconds = {
        "step_s": length(step),
        "compute": length(compute),
        "comm_exposed": length(exposed),
        "bubble": length(bubble),
        "data": length(data),
        "comm_overlapped": length(intersect(union(collective + p2p), compute)),
    }
    seconds["host"] = max(0.0, seconds["step_s"] - sum(seconds[c] for c in CATEGORIES if c != "host"))
    return {k: v / 1e6 for k, v in seconds.items()}  # trace times are microseconds


def _rank_of(path: Path) -> int:
    return int(path.name.split(".")[0].removeprefix("rank"))


def profile_summary(run_dir: Path) -> dict[str, Any]:
    """The breakdown of every trace under RUN/profile/step-<n>/, per step and rank, with the slowest rank
    per step and the step time a plain clock measured beside it ({} when there are no traces)."""
    root = Path(run_dir) / PROFILE_DIR
    steps: dict[str, Any] = {}
    for step_dir in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1])):
        ranks = []
        for trace in sorted(step_dir.glob("rank*.json.gz"), key=_rank_of):
            row: dict[str, Any] = {"rank": _rank_of(trace), "trace": str(trace)}
            try:
                row.update(breakdown(load_events(trace)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            try:
                timing = json.loads(trace.with_name(trace.name.replace(".json.gz", ".timing.json")).read_text())
                row["measured_step_s"] = timing.get("measured_step_s")
            except (OSError, ValueError):
                row["measured_step_s"] = None
            memory = trace.with_name(trace.name.replace(".json.gz", ".memory.pickle"))
            if memory.is_file():
                row["memory_snapshot"] = str(memory)
            ranks.append(row)
        timed = [r for r in ranks if isinstance(r.get("step_s"), float)]
        slowest = max(timed, key=lambda r: r["step_s"])["rank"] if timed else None
        steps[step_dir.name.split("-")[1]] = {"ranks": ranks, "slowest_rank": slowest}
    return {"steps": steps} if steps else {}


def write_profile_summary(run_dir: Path) -> dict[str, Any]:
    """profile_summary() written to RUN/profile/summary.json (when there is a profile)."""
    summary = profile_summary(run_dir)
    if summary:
        path = Path(run_dir) / PROFILE_DIR / SUMMARY_NAME
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def mean_per_rank(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's categories averaged over the profiled steps."""
    acc: dict[int, list[dict]] = {}
    for entry in summary.get("steps", {}).values():
        for row in entry["ranks"]:
            if "step_s" in row:
                acc.setdefault(int(row["rank"]), []).append(row)
    out = []
    for rank, rows in sorted(acc.items()):
        keys = ("step_s", "comm_overlapped", *CATEGORIES)
        mean = {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}
        measured = [float(r["measured_step_s"]) for r in rows if isinstance(r.get("measured_step_s"), (int, float))]
        mean["measured_step_s"] = sum(measured) / len(measured) if measured else None
        out.append({"rank": rank, "steps": len(rows), **mean})
    return out


def breakdown_lines(summary: dict[str, Any], run_dir: Path) -> list[str]:
    """The per-rank breakdown as lines for the terminal (milliseconds)."""
    rows = mean_per_rank(summary)
    if not rows:
        return []
    steps = ", ".join(summary["steps"])
    head = f"{'rank':>6} {'step':>9} {'compute':>9} {'(overlap)':>10} {'exposed':>9} {'bubble':>8} "
    head += f"{'data':>8} {'host':>8} {'clock':>9}"
    lines = [f"step time breakdown, ms (profiled step {steps}; {Path(run_dir) / PROFILE_DIR / SUMMARY_NAME})", head]
    for r in rows:
        ms = {k: 1e3 * float(r[k]) for k in ("step_s", "comm_overlapped", *CATEGORIES)}
        clock = f"{1e3 * r['measured_step_s']:9.1f}" if r["measured_step_s"] is not None else f"{'-':>9}"
        lines.append(
            f"{r['rank']:>6} {ms['step_s']:9.1f} {ms['compute']:9.1f} {ms['comm_overlapped']:10.1f} "
            f"{ms['comm_exposed']:9.1f} {ms['bubble']:8.1f} {ms['data']:8.1f} {ms['host']:8.1f} {clock}"
        )
    slowest = max(rows, key=lambda r: r["step_s"])
    lines.append(f"slowest rank: {slowest['rank']} ({1e3 * slowest['step_s']:.1f} ms per profiled step)")
    return lines
