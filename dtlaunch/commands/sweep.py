"""`train -m` / `submit -m`: Hydra-style sweeps over the cartesian product of override values.

The sweep grammar is Hydra's own (its override parser): `key=a,b`, `key=range(1,4)`, `key=choice(x,y)`.
Every point is composed, validated and planned before the first one starts, so a typo in the last
point does not surface hours into the sweep. Locally the points run one after another, each as its own
`dtlaunch train` process in `<sweep dir>/<index>/` (a crash or a leak in one cannot affect the next);
one failing point does not stop the others, and the exit code says whether all succeeded. On Slurm the
points become one job array.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from dtlaunch.commands.common import Job, console, load_job
from dtlaunch.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_WORKER_FAILED, ConfigError, PlanDoesNotFit

SWEEP_RECORD = "sweep.json"
# Overrides the sweep sets per point itself: a user's value would put every point in the same directory.
_PER_POINT_KEYS = ("run.dir", "run.name")


@dataclass
class Point:
    index: int
    overrides: list[str]  # the complete override list of this point
    swept: list[str]  # only the overrides that vary across the sweep (the table's first column)
    run_dir: Path = Path()
    job: Optional[Job] = None
    status: str = "pending"
    summary: dict = field(default_factory=dict)


def expand_sweep(overrides: Sequence[str]) -> tuple[list[list[str]], set[str]]:
    """The cartesian product of the sweep overrides, in command-line order (the last key varies
    fastest, as in Hydra's basic sweeper), and the keys that vary."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dtlaunch.job.compose import refuse_hydra_overrides

    refuse_hydra_overrides(overrides)
    parser = OverridesParser.create()
    choices: list[list[str]] = []
    swept: set[str] = set()
    for ov in overrides:
        try:
            parsed = parser.parse_overrides([ov])[0]
        except Exception as exc:  # Hydra's parse errors are several types; all are bad input here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"cannot parse '{ov}' as a sweep: {first}; write key=a,b or key=range(start,stop[,step]) "
                f"or key=choice(a,b)"
            ) from exc
        key = parsed.get_key_element()
        if not parsed.is_sweep_override():
            choices.append([ov])
            continue
        kind = parsed.value_type.name if parsed.value_type is not None else "?"
        if not parsed.is_discrete_sweep() or kind == "GLOB_CHOICE_SWEEP":
            raise ConfigError(
                f"'{ov}': {kind.lower().replace('_', ' ')} is not supported by -m here (values must be listed): "
                f"use key=a,b, range(...) or choice(...)"
            )
        values = list(parsed.sweep_string_iterator())
        if not values:
            raise ConfigError(f"'{ov}' sweeps over no values: give at least one")
        choices.append([f"{key}={v}" for v in values])
        if len(values) > 1:
            swept.add(key)
    return [list(p) for p in itertools.product(*choices)], swept


def _key(ov: str) -> str:
    return ov.lstrip("+~").split("=", 1)[0]


def prepare_points(overrides: Sequence[str], recipe_dirs: Sequence[str], force: bool) -> tuple[list[Point], Path]:
    """Expand, compose, validate and plan every point (nothing is created); the sweep directory."""
    from dtlaunch.commands.plan import make_plan
    from dtlaunch.plan.report import gib

    combos, swept_keys = expand_sweep(overrides)
    points: list[Point] = []
    for i, combo in enumerate(combos):
        swept = [ov for ov in combo if _key(ov) in swept_keys]
        label = " ".join(swept) or "(single point)"
        try:
            job = load_job(combo, recipe_dirs, to_run=True)
        except ConfigError as exc:
            raise ConfigError(f"sweep point {i} ({label}): {exc}") from None
        plan = make_plan(job)
        if not plan.fits and not force:
            raise PlanDoesNotFit(
                f"sweep point {i} ({label}): the plan does not fit ({gib(plan.device_total)} of "
                f"{gib(plan.capacity)} GiB on {plan.hardware}); change it or pass --force"
            )
        points.append(Point(index=i, overrides=combo, swept=swept, job=job))
    first = points[0].job
    assert first is not None
    cfg = first.cfg
    if cfg.run.dir:
        sweep_dir = Path(cfg.run.dir)
    else:
        sweep_dir = Path(cfg.run.root) / (cfg.run.name or f"sweep-{first.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    sweep_dir = sweep_dir.resolve()
    for p in points:
        p.run_dir = sweep_dir / str(p.index)
        p.overrides = [ov for ov in p.overrides if _key(ov) not in _PER_POINT_KEYS] + [f"run.dir={p.run_dir}"]
        assert p.job is not None
        # The composed job as its own run would see it (submit creates the run directory from it).
        p.job.cfg.run.dir = str(p.run_dir)
    return points, sweep_dir


def _write_record(sweep_dir: Path, points: list[Point], extra: dict | None = None) -> None:
    data = {
        **(extra or {}),
        "points": [
            {
                "index": p.index,
                "run_dir": str(p.run_dir),
                "overrides": p.overrides,
                "swept": p.swept,
                "status": p.status,
                "summary": p.summary,
            }
            for p in points
        ],
    }
    sweep_dir.mkdir(parents=True, exist_ok=True)
    tmp = sweep_dir / f".{SWEEP_RECORD}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(sweep_dir / SWEEP_RECORD)


def _status_of(rc: int) -> str:
    return {0: "ok", EXIT_PREEMPTED: "preempted", 130: "interrupted", 3: "does not fit"}.get(rc, f"failed (exit {rc})")


def _run_point(cmd: list[str]) -> int:
    """Run one point's `dtlaunch train` to its end. SIGTERM/SIGUSR1 sent to the sweep are passed on (the
    point checkpoints and exits 75, which ends the sweep); Ctrl-C reaches the point directly (one
    process group), so the sweep waits for it to stop its workers instead of killing it."""
    proc = subprocess.Popen(cmd)

    def forward(signum: int, _frame: Any) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def sweep_table(points: list[Point], width: int) -> Any:
    from dtlaunch.report.tables import plain_table

    def num(v: Any, fmt: str) -> str:
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    rows = [
        [
            str(p.index),
            " ".join(p.swept) or "-",
            num(p.summary.get("final_loss"), "{:.4f}"),
            num(p.summary.get("val_loss"), "{:.4f}"),
            num(p.summary.get("tokens_per_s"), "{:,.0f}"),
            p.status if p.status == "ok" else f"[red]{p.status}[/red]",
        ]
        for p in points
    ]
    headers = ["#", "overrides", "final loss", "val loss", "tokens/s", "status"]
    return plain_table(headers, rows, width, title="sweep")


def sweep_train_command(
    overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool, no_resume: bool
) -> int:
    from dtlaunch.run.phases import phase

    phase("composing, validating and planning every sweep point")
    points, sweep_dir = prepare_points(overrides, recipe_dirs, force)
    out = console()
    out.print(f"sweep of {len(points)} run(s) in {sweep_dir}", markup=False)
    for p in points:
        out.print(f"  {p.index}: {' '.join(p.swept) or '(no swept keys)'}", markup=False)
    if dry_run:
        return 0
    _write_record(sweep_dir, points)
    flags = [f for f, on in (("--force", force), ("--no-resume", no_resume)) if on]
    for d in recipe_dirs:
        flags += ["--recipe-dir", d]
    stop = False
    for p in points:
        if stop:
            p.status = "not run"
            continue
        out.rule(f"sweep run {p.index + 1}/{len(points)}: {' '.join(p.swept)}", style="bold")
        rc = _run_point([sys.executable, "-m", "dtlaunch", "train", *flags, *p.overrides])
        p.status = _status_of(rc)
        try:
            p.summary = json.loads((p.run_dir / "summary.json").read_text()) if rc == 0 else {}
        except (OSError, ValueError):
            p.summary = {}
        # The user's Ctrl-C, or a scheduler's stop: the remaining points are not started.
        stop = rc in (130, EXIT_PREEMPTED)
        _write_record(sweep_dir, points)
    out.print(sweep_table(points, out.width))
    out.print(f"sweep directory: {sweep_dir} (results in {SWEEP_RECORD})", markup=False)
    failed = [p for p in points if p.status != "ok"]
    if not failed:
        return 0
    if all(p.status in ("preempted", "not run") for p in failed):
        return EXIT_PREEMPTED
    return EXIT_WORKER_FAILED if any(p.status.startswith("failed") for p in failed) else EXIT_BAD_INPUT


def sweep_submit_command(overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool) -> int:
    """Every point's run directory and script as `submit` writes them, and one job array running them."""
    from dtlaunch.launch import slurm, slurm_script
    from dtlaunch.launch.run_data import prepare_run_data
    from dtlaunch.launch.rundir import create_run_dir

    points, sweep_dir = prepare_points(overrides, recipe_dirs, force)
    for p in points:
        assert p.job is not None
        if p.job.cfg.cluster.kind != "slurm":
            raise ConfigError(
                f"cluster.kind='{p.job.cfg.cluster.kind}': a sweep (-m) is submitted as a Slurm job array only; "
                f"add cluster=slurm, or submit each point without -m"
            )
    script = slurm_script.render_array_script([p.job.cfg for p in points], [p.run_dir for p in points], sweep_dir)
    if dry_run:
        print(script, end="")  # the script alone on stdout, as `submit --dry-run`
        return 0
    for p in points:
        run_dir = create_run_dir(p.job.cfg, p.job.recipe)
        prepare_run_data(p.job.cfg, run_dir)
        slurm_script.write_script(p.job.cfg, run_dir)
    job_id = slurm.submit_array(script, sweep_dir, [p.run_dir for p in points])
    _write_record(sweep_dir, points, {"slurm_array_job_id": job_id})
    out = console()
    out.print(f"submitted job array {job_id} ({len(points)} tasks)", markup=False)
    eval_ids = [str(slurm.read_record(p.run_dir).get("eval_job_id") or "") for p in points]
    if any(eval_ids):  # training.eval_tasks: point i's evaluation job waits for array task i
        listed = ", ".join(f"{job_id}_{i}: {e}" for i, e in enumerate(eval_ids) if e)
        out.print(
            f"submitted evaluation jobs (each starts once its task has succeeded): {listed}",
            markup=False,
            soft_wrap=True,
        )
    out.print(f"sweep directory: {sweep_dir}", markup=False)
    out.print(f"follow a task with: dtlaunch status {points[0].run_dir}", markup=False)
    return 0
