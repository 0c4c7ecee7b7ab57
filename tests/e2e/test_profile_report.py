"""Profiling and `dtlaunch report` end to end.

A 2-rank FSDP run on CPU profiles step 3: every rank's trace loads as JSON and shows gloo's collectives,
the printed breakdown's categories add up to the step a plain clock measured (within 10 %), and the
report of the finished run, of the same run resumed to more steps, of a failed run and of a sweep is one
self-contained HTML file whose figures are well-formed SVG. Where a headless Chromium is installed, it
renders the page too.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROFILED = [
    "recipe=tiny_fsdp",
    "training.steps=4",
    "checkpoint.enabled=true",
    "checkpoint.every_steps=2",
    "profiling.enabled=true",
    "profiling.steps=[3]",
]
CATEGORIES = ("compute", "comm_exposed", "bubble", "data", "host")


class _Page(HTMLParser):
    """The parts of a page the tests look at: headings, <svg> elements (their raw text) and every
    attribute that could load something from elsewhere."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.external: list[str] = []
        self.scripts = 0
        self._in_heading = False
        self.feed(text)
        starts = [i for i in range(len(text)) if text.startswith("<svg", i)]
        self.svgs = [text[i : text.index("</svg>", i) + len("</svg>")] for i in starts]

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._in_heading = tag in ("h1", "h2", "h3")
        self.scripts += tag == "script"
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith("#"):
                self.external.append(value)

    def handle_data(self, data: str) -> None:
        if self._in_heading and data.strip():
            self.headings.append(data.strip())

    def handle_endtag(self, tag: str) -> None:
        if tag in ("h1", "h2", "h3"):
            self._in_heading = False


def _report(trainer, path: Path, out: Path, cli: bool = False) -> _Page:
    """The report of `path` written to `out`: through the CLI, or in this process (no interpreter and
    matplotlib start-up per report)."""
    if cli:
        proc = trainer.cli(["report", str(path), "--out", str(out)])
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        from dtlaunch.commands.report import report_command

        assert report_command(str(path), str(out)) == 0
    page = _Page(out.read_text())
    assert page.scripts == 0 and page.external == [], page.external  # self-contained
    for svg in page.svgs:
        ET.fromstring(svg)  # well-formed XML
    return page


@pytest.fixture(scope="module")
def profiled_run(trainer, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("profiled") / "run"
    proc = trainer.run(run_dir, *PROFILED)
    return run_dir, proc.stdout


def test_traces_load_and_the_breakdown_adds_up_to_the_measured_step(profiled_run) -> None:
    run_dir, stdout = profiled_run
    for rank in (0, 1):
        with gzip.open(run_dir / "profile" / "step-3" / f"rank{rank}.json.gz", "rt") as f:
            trace = json.load(f)
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "dtlaunch.step" in names and any(str(n).startswith("gloo:") for n in names), sorted(names)[:50]
    assert not (run_dir / "profile" / "step-2").exists()  # the warm-up step keeps nothing
    summary = json.loads((run_dir / "profile" / "summary.json").read_text())
    ranks = summary["steps"]["3"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        total = sum(r[c] for c in CATEGORIES)
        assert abs(total - r["measured_step_s"]) <= 0.1 * r["measured_step_s"], r
        assert r["compute"] > 0 and r["comm_overlapped"] + r["comm_exposed"] > 0, r  # FSDP communicates
        assert r["bubble"] == 0, r  # no pipeline
    assert summary["steps"]["3"]["slowest_rank"] in (0, 1)
    assert "step time breakdown" in stdout and "slowest rank:" in stdout, stdout[-3000:]


def test_report_of_a_finished_then_resumed_run(trainer, profiled_run, tmp_path: Path) -> None:
    run_dir, _ = profiled_run
    page = _report(trainer, run_dir, tmp_path / "finished.html", cli=True)
    assert {"loss", "throughput", "memory", "config"} <= set(page.headings), page.headings
    assert any(h.startswith("step time breakdown") for h in page.headings), page.headings
    # loss, throughput, memory, breakdown, and the step time per rank (rank_step_s: the slow-rank report)
    assert len(page.svgs) == 5, len(page.svgs)
    assert "step time per rank" in page.headings, page.headings
    # The same run extended to 6 steps resumes from its step-4 checkpoint.
    trainer.run(run_dir, *PROFILED[:-1], "training.steps=6", "profiling.steps=[5]")
    _report(trainer, run_dir, tmp_path / "resumed.html")
    body = (tmp_path / "resumed.html").read_text()
    assert "resumed after step 4" in body and "started at step 1" in body
    assert "step-00000006" in body


BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium") or shutil.which("google-chrome")


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed")
def test_report_renders_in_a_headless_browser(trainer, profiled_run, tmp_path: Path) -> None:
    """Chromium's DOM of the page holds every figure as an SVG element (its parser accepted them), and a
    screenshot of the page is drawn."""
    html = tmp_path / "report.html"
    page = _report(trainer, profiled_run[0], html)
    common = [str(BROWSER), "--headless", "--no-sandbox", "--disable-gpu"]
    proc = subprocess.run([*common, "--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("<svg") == len(page.svgs) > 0 and "</html>" in proc.stdout, proc.stdout[:2000]
    shot = tmp_path / "report.png"
    proc = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1200,2000", html.as_uri()], timeout=120)
    assert proc.returncode == 0 and shot.read_bytes().startswith(b"\x89PNG")


def test_report_of_a_failed_run_and_of_a_sweep(trainer, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = trainer.cli(
        [
            "train",
            "-m",
            *trainer.FAST,
            "recipe=tiny_ddp",
            "launch.nproc_per_node=1",
            "training.steps=3",
            "debug.fail_at_step=-1,3",
            f"run.dir={sweep}",
        ]
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # the second point failed
    failed = _report(trainer, sweep / "1", tmp_path / "failed.html")
    body = (tmp_path / "failed.html").read_text()
    assert "(failed)" in body and "injected failure at step 3" in body
    assert "loss" in failed.headings  # the steps it logged before failing
    page = _report(trainer, sweep, tmp_path / "sweep.html")
    body = (tmp_path / "sweep.html").read_text()
    assert "debug.fail_at_step=-1" in body and "failed (exit 1)" in body
    assert {"loss", "throughput", "memory"} <= set(page.headings), page.headings
