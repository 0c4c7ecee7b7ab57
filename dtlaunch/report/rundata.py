"""What a report shows, read from a run directory's files (no torch): metrics.jsonl, summary.json,
plan.json, config.yaml, state.json, the checkpoints, the rank logs (attempts and resumes) and the
profile summary."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import CONFIG_NAME, LOGS_DIR, METRICS_NAME, STATE_NAME

# "training steps 5..6" in a rank log: a launch that started after step 4 resumed from a checkpoint.
_STEPS_LINE = re.compile(r"training steps (\d+)\.\.(\d+)")
_ATTEMPT_LINE = re.compile(r"^--- rank 0, attempt (\d+), pid \d+, (.+)$")


@dataclass
class Launch:
    """One start of the workers, as rank 0's log tells it."""

    started: str
    attempt: int
    first_step: Optional[int] = None
    last_step: Optional[int] = None

    @property
    def resumed_from(self) -> Optional[int]:
        return self.first_step - 1 if self.first_step and self.first_step > 1 else None


@dataclass
class RunData:
    run_dir: Path
    config_text: str
    config: dict
    state: dict
    metrics: list[dict]
    summary: dict
    plan: dict
    checkpoints: list[dict]
    launches: list[Launch]
    profile: dict
    errors: list[str] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # RUN/eval/<time>.json, oldest first

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def status(self) -> str:
        if self.state.get("state"):
            return str(self.state["state"])
        return "finished" if self.summary else "unknown"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric; a step logged twice (re-run after a resume) keeps its last value."""
        by_step: dict[int, float] = {}
        for row in self.metrics:
            v = row.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(row.get("step"), int):
                by_step[row["step"]] = float(v)
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]

    def rank_step_times(self) -> dict[int, float]:
        """Each rank's mean step time (s) where the metrics carry per-rank step times (a list per line
        under a key starting with `rank_step`)."""
        sums: dict[int, list[float]] = {}
        for row in self.metrics:
            for key, value in row.items():
                if key.startswith("rank_step") and isinstance(value, list):
                    for rank, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            sums.setdefault(rank, []).append(float(v))
        return {r: sum(v) / len(v) for r, v in sorted(sums.items()) if v}


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _metrics(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _launches(log: Path) -> list[Launch]:
    out: list[Launch] = []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        m = _ATTEMPT_LINE.match(line)
        if m:
            out.append(Launch(started=m.group(2), attempt=int(m.group(1))))
            continue
        m = _STEPS_LINE.search(line)
        if m and out:
            out[-1].first_step, out[-1].last_step = int(m.group(1)), int(m.group(2))
    return out


def _checkpoints(run_dir: Path, config: dict) -> list[dict]:
    from dtlaunch.run.checkpoints import scan_checkpoints

    ckpt = config.get("checkpoint") or {}
    root = Path(str(ckpt.get("dir") or "checkpoints"))
    root = root if root.is_absolute() else run_dir / root
    out = []
    for info in scan_checkpoints(root):
        size = sum(f.stat().st_size for f in info.path.rglob("*") if f.is_file())
        out.append({"step": info.step, "path": str(info.path), "complete": info.complete, "bytes": size})
    return out


def read_run(run_dir: Path) -> RunData:
    """Everything a run report shows; an InputError (exit 2) when `run_dir` is not a run directory."""
    import yaml

    run_dir = Path(run_dir)
    config_path = run_dir / CONFIG_NAME
    if not config_path.is_file():
        raise InputError(f"'{run_dir}' is not a dtlaunch run directory (no config.yaml): give runs/<name>")
    text = config_path.read_text()
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        config = {}
    from dtlaunch.report.breakdown import profile_summary
    from dtlaunch.run.profile_files import PROFILE_DIR, SUMMARY_NAME

    return RunData(
        run_dir=run_dir,
        config_text=text,
        config=config if isinstance(config, dict) else {},
        state=_json(run_dir / STATE_NAME),
        metrics=_metrics(run_dir / METRICS_NAME),
        summary=_json(run_dir / "summary.json"),
        plan=_json(run_dir / "plan.json"),
        checkpoints=_checkpoints(run_dir, config if isinstance(config, dict) else {}),
        launches=_launches(run_dir / LOGS_DIR / "rank0.log"),
        profile=_json(run_dir / PROFILE_DIR / SUMMARY_NAME) or profile_summary(run_dir),
        evals=[e for e in (_json(p) for p in sorted((run_dir / "eval").glob("*.json"))) if e.get("results")],
    )


def planned_bytes_of_rank(plan: dict, rank: int) -> dict[str, int]:
    """The plan's lines (category -> bytes, overheads included) for the pipeline stage `rank` holds
    (pp is the outermost mesh dimension); the whole plan's lines without pipeline stages."""
    layout = plan.get("layout") or {}
    world, pp = int(layout.get("world") or 1), int(layout.get("pp") or 1)
    stage = rank // max(1, world // max(1, pp))
    lines = dict(plan.get("categories") or {})
    for s in plan.get("stages") or []:
        if int(s.get("stage", -1)) == stage and s.get("categories"):
            lines = dict(s["categories"])
    lines.update(plan.get("overheads") or {})
    return {k: int(v) for k, v in lines.items() if isinstance(v, (int, float)) and v > 0}
