"""RUN/metrics.jsonl, read back: the records, the loss plot, and byte counts as people read them.

Torch-free: the launcher's summary, `status`, the report and the benchmarks read runs with these; the
worker's MetricsLogger (dtlaunch.train.observe.metrics) writes the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every parseable line of a metrics.jsonl (a torn last line after a crash is skipped)."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def write_loss_plot(metrics_path: Path, png_path: Path, title: str = "") -> Optional[Path]:
    """Loss (and lr, right axis) against step from metrics.jsonl, the whole run including resumes."""
    recs = [r for r in read_metrics(metrics_path) if isinstance(r.get("loss"), (int, float))]
    if not recs:
        return None
    by_step = {r["step"]: r for r in recs}  # a resumed run re-logs steps: keep the latest
    steps = sorted(by_step)
    import matplotlib

    matplotlib.use("Agg")  # no display in workers or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [by_step[s]["loss"] for s in steps], color="tab:blue", label="loss")
    val = [
        (r["step"], r["val_loss"]) for r in read_metrics(metrics_path) if isinstance(r.get("val_loss"), (int, float))
    ]
    if val:
        val_by_step = dict(val)
        vs = sorted(val_by_step)
        ax.plot(vs, [val_by_step[s] for s in vs], "o-", color="tab:green", label="val_loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if all(isinstance(by_step[s].get("lr"), (int, float)) for s in steps):
        ax2 = ax.twinx()
        ax2.plot(steps, [by_step[s]["lr"] for s in steps], color="tab:orange", alpha=0.6, label="lr")
        ax2.set_ylabel("lr")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
