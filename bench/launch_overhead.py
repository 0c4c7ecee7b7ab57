"""Start-up costs: whole-process wall time of the CLI commands a user waits for, against their goals.

Each command runs `reps` times as a fresh process (no warm interpreter), so the figures include Python
start-up and imports, as the user sees them. `import torch` alone is timed as the floor everything that
needs torch pays. Time-to-first-step of `dtlaunch train` vs `torchrun bench/handwritten.py` comes from
the throughput runs (bench/throughput.py, the first metrics line appearing on disk).

    python bench/launch_overhead.py [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import command_line, markdown_table, min_med_max, stats, time_process_cpu, venv_bin

# (name, command, goal in seconds or None)
COMMANDS: list[tuple[str, list[str], Optional[float]]] = [
    ("python -c 'import torch' (floor)", [sys.executable, "-c", "import torch"], None),
    ("dtlaunch --help", [venv_bin("dtlaunch"), "--help"], 0.3),
    ("dtlaunch plan recipe=llama405b_3d", [venv_bin("dtlaunch"), "plan", "recipe=llama405b_3d"], 1.5),
    (
        "dtlaunch plan recipe=llama405b_3d --search (1,024 GPUs)",
        [venv_bin("dtlaunch"), "plan", "recipe=llama405b_3d", "--search"],
        2.0,
    ),
]


def run(reps: int = 5) -> list[dict[str, Any]]:
    """Alternate the commands within each repetition, so load changes spread over all of them. Each
    command's CPU time (user + system) is kept beside its wall time: on a machine others load, the wall
    time grows with their load, the CPU time hardly."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in COMMANDS}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in COMMANDS}
    errors: dict[str, str] = {}
    for _ in range(reps):
        for name, cmd, _ in COMMANDS:
            try:
                wall, used = time_process_cpu(cmd)
            except Exception as exc:  # noqa: BLE001 - a failing command is a result to report, not a crash
                errors[name] = str(exc).splitlines()[0][:300]
                continue
            times[name].append(wall)
            cpu[name].append(used)
    return [
        {
            "name": name,
            "command": command_line(cmd),
            "goal_s": goal,
            "seconds": stats(times[name]),
            "cpu_seconds": stats(cpu[name]),
            "error": errors.get(name, ""),
        }
        for name, cmd, goal in COMMANDS
    ]


def first_step_rows(throughput_summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Time to first completed step per throughput case: dtlaunch, hand-written, and the difference."""
    rows = []
    for c in throughput_summary.get("cases", []):
        dt, hw = c["dtlaunch_first_step_s"], c["handwritten_first_step_s"]
        extra = dt["median"] - hw["median"] if dt["n"] and hw["n"] else None
        rows.append({"case": c["case"], "dtlaunch": dt, "handwritten": hw, "extra_s": extra, "goal_extra_s": 1.0})
    return rows


def _verdict(value: Optional[float], goal: Optional[float]) -> str:
    if value is None or goal is None:
        return "-"
    return "yes" if value <= goal else "no"


def table(rows: list[dict[str, Any]], first_steps: list[dict[str, Any]]) -> str:
    lines = [
        [
            r["name"],
            min_med_max(r["seconds"]),
            min_med_max(r.get("cpu_seconds", {})),
            f"< {r['goal_s']}" if r["goal_s"] else "-",
            _verdict(r["seconds"]["median"], r["goal_s"]) if not r["error"] else f"error: {r['error']}",
        ]
        for r in rows
    ]
    for f in first_steps:
        lines.append(
            [
                f"first step, {f['case']}: dtlaunch {min_med_max(f['dtlaunch'])} vs hand-written "
                f"{min_med_max(f['handwritten'])}",
                f"+{f['extra_s']:.2f}" if f["extra_s"] is not None else "-",
                "-",
                "≤ +1.0",
                _verdict(f["extra_s"], f["goal_extra_s"]),
            ]
        )
    return markdown_table(["what", "seconds, median (min–max)", "CPU seconds", "goal", "met"], lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(table(run(args.reps), []))


if __name__ == "__main__":
    main()
