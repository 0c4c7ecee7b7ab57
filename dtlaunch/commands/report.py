"""`report RUN|SWEEP_DIR [--out FILE]`: one self-contained HTML page of a run (finished, failed, resumed or
still running) or of a sweep's points side by side. Reads the directory's files only (no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import CONFIG_NAME

REPORT_NAME = "report.html"


def build_report(path: Path) -> str:
    """The HTML text for a run directory or a sweep directory (one holding sweep.json)."""
    from dtlaunch.commands.sweep import SWEEP_RECORD
    from dtlaunch.report.html import run_report, sweep_report
    from dtlaunch.report.rundata import read_run

    record_path = path / SWEEP_RECORD
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
        except ValueError as exc:
            raise InputError(f"{record_path} is not valid JSON ({exc}): is the sweep still being written?") from exc
        runs = []
        for point in record.get("points") or []:
            run_dir = Path(str(point.get("run_dir") or ""))
            runs.append(read_run(run_dir) if (run_dir / CONFIG_NAME).is_file() else None)
        return sweep_report(path, record, runs)
    return run_report(read_run(path))


def report_command(run: str, out: Optional[str]) -> int:
    from dtlaunch.commands.common import console

    path = Path(run)
    if not path.is_dir():
        raise InputError(f"'{run}' is not a directory: give a run directory (runs/<name>) or a sweep directory")
    text = build_report(path)
    target = Path(out) if out else path / REPORT_NAME
    target.write_text(text, encoding="utf-8")
    console().print(f"report: {target}", markup=False, soft_wrap=True)
    return 0
