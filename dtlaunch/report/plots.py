"""The report's figures: matplotlib, written as SVG text to inline in the HTML page (vector, no files).

Every figure gets its own `svg.hashsalt`, so the ids matplotlib puts in one SVG (clip paths, glyphs)
cannot collide with another's in the same page.
"""

from __future__ import annotations

import io
import itertools
from typing import Any, Optional, Sequence

MIB = 2**20
_counter = itertools.count()
_CATEGORY_COLOURS = {
    "compute": "#4c72b0",
    "comm_exposed": "#dd8452",
    "bubble": "#c44e52",
    "data": "#55a868",
    "host": "#8c8c8c",
}
_CATEGORY_LABELS = {
    "compute": "compute",
    "comm_exposed": "exposed communication",
    "bubble": "pipeline bubble",
    "data": "data loading",
    "host": "host / other",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    """The figure as an <svg> element (the XML declaration and doctype dropped for inlining)."""
    import matplotlib

    plt = _pyplot()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"dtlaunch-fig{next(_counter)}", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def line_plot(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    ylabel: str,
    title: str,
    right: Optional[tuple[str, Sequence[float], Sequence[float], str]] = None,
    markers: bool = False,
    marks: Sequence[tuple[float, str]] = (),
) -> str:
    """Lines (label, x, y) against step; `right`: one more line on a second y axis (label, x, y, ylabel);
    `marks`: vertical dashed lines (step, label), e.g. where a run resumed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for label, x, y in series:
        ax.plot(x, y, "o-" if markers or len(x) < 3 else "-", label=label, markersize=3)
    for step, label in marks:
        ax.axvline(step, color="grey", linestyle=":", lw=1)
        ax.annotate(
            label,
            (step, 0.03),
            xycoords=("data", "axes fraction"),
            xytext=(3, 0),
            textcoords="offset points",
            fontsize="small",
            color="grey",
        )
    xs = [v for _, x, _ in series for v in x]
    if xs and min(xs) == max(xs):  # one point: a readable axis around it
        ax.set_xlim(min(xs) - 1, max(xs) + 1)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        label, x, y, rlabel = right
        ax2 = ax.twinx()
        ax2.plot(x, y, "--", color="tab:red", label=label, alpha=0.8)
        ax2.set_ylabel(rlabel)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if len(labels) > 1:
        ax.legend(handles, labels, loc="best", fontsize="small")
    return _svg(fig)


def memory_plot(measured: dict[int, int], planned: dict[int, dict[str, int]]) -> str:
    """Per rank: the measured peak (one bar) beside the plan's lines stacked (the planned peak)."""
    plt = _pyplot()
    ranks = sorted(set(measured) | set(planned))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(ranks) + 3), 3.6))
    width = 0.38
    categories = sorted({c for lines in planned.values() for c in lines})
    colours = dict(zip(categories, itertools.cycle(plt.get_cmap("tab20").colors), strict=False))
    labelled: set[str] = set()

    def label(text: str) -> str | None:  # each legend entry once
        if text in labelled:
            return None
        labelled.add(text)
        return text

    for i, rank in enumerate(ranks):
        if rank in measured:
            ax.bar(i - width / 2, measured[rank] / MIB, width, color="#333333", label=label("measured"))
        bottom = 0.0
        for c in categories:
            v = planned.get(rank, {}).get(c, 0) / MIB
            if v > 0:
                ax.bar(i + width / 2, v, width, bottom=bottom, color=colours[c], label=label(f"plan: {c}"))
                bottom += v
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory per rank: measured (left) vs planned (right, stacked)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def breakdown_plot(rows: list[dict[str, Any]]) -> str:
    """Per rank, the profiled step split into the breakdown's categories (ms), as stacked bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.8))
    for i, row in enumerate(rows):
        left = 0.0
        for c, colour in _CATEGORY_COLOURS.items():
            v = 1e3 * float(row.get(c) or 0.0)
            ax.barh(i, v, left=left, color=colour, label=_CATEGORY_LABELS[c] if i == 0 else None)
            left += v
        if isinstance(row.get("measured_step_s"), (int, float)):
            ax.plot([1e3 * row["measured_step_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
    ax.set_yticks(range(len(rows)), [f"rank {r['rank']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms per profiled step (black tick: the step measured by a plain clock)")
    ax.set_title("where a step's time goes (torch.profiler trace)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize="small")
    return _svg(fig)


def bar_plot(labels: Sequence[str], values: Sequence[float], ylabel: str, title: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels) + 2), 3.2))
    ax.bar(range(len(labels)), values, color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 4 else 0, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)
