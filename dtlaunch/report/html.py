"""One self-contained HTML page for a run or a sweep: inline SVG figures, tables, the config; no scripts,
no external files, so it opens anywhere and can be mailed or attached to an issue."""

from __future__ import annotations

import datetime
import json
import statistics
from html import escape
from pathlib import Path
from typing import Any, Optional

from dtlaunch.report import plots
from dtlaunch.report.breakdown import CATEGORIES, mean_per_rank
from dtlaunch.report.rundata import RunData, planned_bytes_of_rank

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { padding: 0.2em 0.8em; text-align: left; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; } td.num { text-align: right; }
.state-finished { color: #2a7d2a; } .state-failed { color: #b22; } .state-preempted { color: #b60; }
.error { background: #fee; border: 1px solid #e99; padding: 0.5em; }
figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


def _bytes(n: Any) -> str:
    from dtlaunch.run.metrics_file import human_bytes

    return human_bytes(float(n)) if isinstance(n, (int, float)) else "-"


def _num(v: Any, fmt: str = "{:.4f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _table(headers: list[str], rows: list[list[str]], numeric: tuple[int, ...] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if i in numeric else ''}>{escape(c)}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, body: list[str]) -> str:
    made = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body) + f"\n<p><small>dtlaunch report, {made}</small></p>"
        "</body></html>\n"
    )


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def _measured_peaks(run: RunData) -> dict[int, int]:
    per_rank = run.summary.get("peak_mem_bytes_per_rank")
    if isinstance(per_rank, list) and per_rank:
        return {r: int(v) for r, v in enumerate(per_rank) if isinstance(v, (int, float))}
    _, peaks = run.series("peak_mem_bytes")  # no summary (failed, running): rank 0's, from its metrics
    return {0: int(max(peaks))} if peaks else {}


def _numbers(run: RunData) -> dict[str, Any]:
    """summary.json, completed for a run without one (failed, preempted, running) by its metrics so far."""
    _, losses = run.series("loss")
    _, speeds = run.series("tokens_per_s")
    peaks = _measured_peaks(run)
    return {
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "peak_mem_bytes_measured": max(peaks.values()) if peaks else None,
        **{k: v for k, v in run.summary.items() if v is not None},
    }


def _overview(run: RunData) -> str:
    s, cfg = _numbers(run), run.config
    layout = run.plan.get("layout") or {}
    steps = (cfg.get("training") or {}).get("steps")
    last_step = run.metrics[-1].get("step") if run.metrics else None
    rows = [
        ["state", run.status],
        ["recipe", str(cfg.get("recipe") or "-")],
        ["model", str((cfg.get("model") or {}).get("name") or "-")],
        ["layout", ", ".join(f"{k} {v}" for k, v in layout.items()) or "-"],
        ["steps", f"{last_step if last_step is not None else '-'} of {steps if steps is not None else '?'}"],
        ["final loss", _num(s.get("final_loss"))],
        ["val loss", _num(s.get("val_loss"))],
        ["tokens/s (median)", _num(s.get("tokens_per_s"), "{:,.0f}")],
        ["MFU", _num(s.get("mfu") * 100 if isinstance(s.get("mfu"), float) else None, "{:.1f} %")],
        [
            "peak memory",
            f"{_bytes(s.get('peak_mem_bytes_measured'))} measured, {_bytes(run.plan.get('peak_bytes'))} planned",
        ],
        ["wall time", _num(s.get("wall_time_s"), "{:.1f} s")],
    ]
    html = _table(["", ""], rows)
    if run.state.get("error"):
        html += f'<p class="error">{escape(str(run.state["error"]))}</p>'
    return html


def _history(run: RunData) -> str:
    rows = []
    for la in run.launches:
        what = f"resumed after step {la.resumed_from}" if la.resumed_from else "started at step 1"
        steps = f"{la.first_step}..{la.last_step}" if la.first_step else "-"
        rows.append([la.started, str(la.attempt), steps, what])
    html = _table(["launched", "attempt", "steps", ""], rows) if rows else "<p>no worker log</p>"
    ck = [
        [str(c["step"]), "complete" if c["complete"] else "incomplete", _bytes(c["bytes"]), c["path"]]
        for c in run.checkpoints
    ]
    html += "<h3>checkpoints on disk</h3>"
    html += _table(["step", "", "size", "path"], ck, numeric=(0,)) if ck else "<p>none</p>"
    return html


def _profile_section(run: RunData) -> list[str]:
    rows = mean_per_rank(run.profile)
    if not rows:
        return []
    steps = ", ".join(run.profile.get("steps", {}))
    table = [
        [str(r["rank"])]
        + [f"{1e3 * r[k]:.1f}" for k in ("step_s", *CATEGORIES, "comm_overlapped")]
        + [_num(r["measured_step_s"] and 1e3 * r["measured_step_s"], "{:.1f}")]
        for r in rows
    ]
    headers = ["rank", "step", "compute", "exposed comm", "bubble", "data", "host", "comm overlapped", "clock"]
    slowest = max(rows, key=lambda r: r["step_s"])
    return [
        f"<h2>step time breakdown (profiled step {escape(steps)}, ms)</h2>",
        _figure(plots.breakdown_plot(rows), "mean over the profiled steps; traces in profile/step-N/rankR.json.gz"),
        _table(headers, table, numeric=tuple(range(1, len(headers)))),
        f"<p>slowest rank: {slowest['rank']}</p>",
    ]


def _eval_section(run: RunData) -> list[str]:
    """lm-evaluation-harness results (`dtlaunch eval`, training.eval_tasks), one row per metric."""
    if not run.evals:
        return []
    from dtlaunch.infer.harness import metric_rows

    rows = [
        [str(e.get("time", "")), str(e.get("step", "")), task, metric, f"{value:.4f}", _num(err)]
        for e in run.evals
        for task, metric, value, err in metric_rows(e["results"])
    ]
    headers = ["time", "step", "task", "metric", "value", "stderr"]
    return ["<h2>evaluation (lm-evaluation-harness)</h2>", _table(headers, rows, numeric=(1, 4, 5))]


def run_report(run: RunData) -> str:
    """The HTML page of one run."""
    body = [f"<h1>run {escape(run.name)} <span class='state-{escape(run.status)}'>({escape(run.status)})</span></h1>"]
    body.append(f"<p>{escape(str(run.run_dir))}</p>")
    body.append(_overview(run))
    body.append("<h2>loss</h2>")
    steps, loss = run.series("loss")
    if steps:
        series = [("loss", steps, loss)]
        vs, vl = run.series("val_loss")
        if vs:
            series.append(("val_loss", vs, vl))
        marks = [(la.resumed_from, f"resumed after {la.resumed_from}") for la in run.launches if la.resumed_from]
        figure = plots.line_plot(series, "loss", "training and validation loss", marks=marks)
        caption = "per optimizer step" + ("; dotted lines: where the run resumed from a checkpoint" if marks else "")
        body.append(_figure(figure, caption))
    else:
        body.append("<p>no metrics logged</p>")
    ts, tps = run.series("tokens_per_s")
    if ts:
        ms, mfu = run.series("mfu")
        right = ("MFU", ms, [100 * m for m in mfu], "MFU (%)") if ms else None
        body.append("<h2>throughput</h2>")
        body.append(_figure(plots.line_plot([("tokens/s", ts, tps)], "tokens/s", "throughput", right), ""))
    rs, margins = run.series("rewards/margins")
    if rs:  # preference objectives (dtlaunch.train.objectives): TRL's reward metrics
        curves = [(k.split("/")[1], *run.series(k)) for k in ("rewards/chosen", "rewards/rejected")]
        acc = ("accuracy", *run.series("rewards/accuracies"), "reward accuracy")
        body.append("<h2>rewards</h2>")
        body.append(_figure(plots.line_plot([*curves, ("margin", rs, margins)], "reward", "rewards", acc), ""))
    rs, rewards = run.series("reward")
    if rs:  # objective=grpo (dtlaunch.train.objectives.rollout): each rollout's rewards, per function too
        per_func = sorted({k for row in run.metrics for k in row if k.startswith("rewards/") and k.endswith("/mean")})
        curves = [("mean", rs, rewards), *((k.split("/")[1], *run.series(k)) for k in per_func)]
        length = ("mean length", *run.series("completions/mean_length"), "completion tokens")
        body.append("<h2>rewards</h2>")
        body.append(_figure(plots.line_plot(curves, "reward", "rewards", length), "per rollout"))
    measured = _measured_peaks(run)
    world = int((run.plan.get("layout") or {}).get("world") or len(measured) or 1)
    planned = {r: planned_bytes_of_rank(run.plan, r) for r in range(world)} if run.plan else {}
    if measured or planned:
        body.append("<h2>memory</h2>")
        body.append(_figure(plots.memory_plot(measured, planned), "planned: the memory plan's lines (plan.json)"))
    rank_times = run.rank_step_times()
    if rank_times:
        body.append("<h2>step time per rank</h2>")
        labels = [f"rank {r}" for r in rank_times]
        body.append(_figure(plots.bar_plot(labels, [1e3 * t for t in rank_times.values()], "ms", "mean step time"), ""))
    body += _profile_section(run)
    body += _eval_section(run)
    body.append("<h2>launches, resumes and checkpoints</h2>")
    body.append(_history(run))
    body.append("<h2>config</h2>")
    body.append(f"<pre>{escape(run.config_text)}</pre>")
    return _page(f"dtlaunch run {run.name}", body)


def sweep_report(sweep_dir: Path, record: dict, runs: list[Optional[RunData]]) -> str:
    """The HTML page of a sweep: its points side by side (table, loss curves, speed, memory)."""
    points = record.get("points") or []
    labels = [f"#{p.get('index')}" for p in points]
    rows = []
    for p, run in zip(points, runs, strict=True):
        s = {**(_numbers(run) if run else {}), **(p.get("summary") or {})}
        rows.append(
            [
                f"#{p.get('index')}",
                " ".join(p.get("swept") or []) or "-",
                str(p.get("status")),
                _num(s.get("final_loss")),
                _num(s.get("val_loss")),
                _num(s.get("tokens_per_s"), "{:,.0f}"),
                _bytes(s.get("peak_mem_bytes_measured")),
                str(p.get("run_dir")),
            ]
        )
    body = [f"<h1>sweep {escape(Path(sweep_dir).name)} ({len(points)} points)</h1>", f"<p>{escape(str(sweep_dir))}</p>"]
    headers = ["#", "swept", "status", "final loss", "val loss", "tokens/s", "peak memory", "run directory"]
    body.append(_table(headers, rows, numeric=(3, 4, 5)))
    curves = []
    for label, p, run in zip(labels, points, runs, strict=True):
        if run is not None:
            steps, loss = run.series("loss")
            if steps:
                curves.append((f"{label} {' '.join(p.get('swept') or [])}", steps, loss))
    if curves:
        body.append("<h2>loss</h2>")
        body.append(_figure(plots.line_plot(curves, "loss", "training loss per point"), ""))
    speeds = [(lab, r[5]) for lab, r in zip(labels, rows, strict=True) if r[5] != "-"]
    if speeds:
        body.append("<h2>throughput</h2>")
        values = [float(v.replace(",", "")) for _, v in speeds]
        body.append(_figure(plots.bar_plot([lab for lab, _ in speeds], values, "tokens/s", "median tokens/s"), ""))
    mems = [(lab, _numbers(run).get("peak_mem_bytes_measured")) for lab, run in zip(labels, runs, strict=True) if run]
    mems = [(lab, m) for lab, m in mems if isinstance(m, (int, float))]
    if mems:
        body.append("<h2>memory</h2>")
        values = [m / plots.MIB for _, m in mems]
        body.append(
            _figure(plots.bar_plot([lab for lab, _ in mems], values, "MiB", "peak memory (most loaded rank)"), "")
        )
    body.append("<h2>sweep record</h2>")
    body.append(f"<pre>{escape(json.dumps(record, indent=2))}</pre>")
    return _page(f"dtlaunch sweep {Path(sweep_dir).name}", body)
