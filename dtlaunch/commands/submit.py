"""`submit` and `status`: run a job on Slurm, and look at it later.

submit: compose -> validate -> plan gate -> run directory (+ data, prepared once here on the login node)
-> sbatch script -> sbatch. The job id is kept in run_dir/slurm.json so `status RUN` can find it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dtlaunch.commands.common import Job, console, load_job, summary_table
from dtlaunch.errors import ConfigError, InputError


def _plan_gate(job: Job, force: bool, to_stderr: bool) -> None:
    """The planner's gate (prints the plan; raises PlanDoesNotFit, exit 3), when the planner provides one."""
    import contextlib
    import sys

    try:
        from dtlaunch.commands.plan import plan_gate
    except ImportError:
        return
    # A dry run keeps stdout for the script alone (`dtlaunch submit ... --dry-run > job.sbatch`).
    with contextlib.redirect_stdout(sys.stderr) if to_stderr else contextlib.nullcontext():
        plan_gate(job, force=force)


def submit_command(overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool) -> int:
    from dtlaunch.launch import slurm
    from dtlaunch.launch.rundir import run_dir_for

    job = load_job(overrides, recipe_dirs)
    if job.cfg.cluster.kind not in ("slurm", "kubernetes", "skypilot"):
        raise ConfigError(
            f"cluster.kind='{job.cfg.cluster.kind}' cannot be submitted: add cluster=slurm, kubernetes or skypilot"
        )
    _plan_gate(job, force, to_stderr=dry_run)
    from dtlaunch.commands.eval import check_eval_tasks

    check_eval_tasks(job.cfg)  # training.eval_tasks: a bad task name is exit 2 now, not after the job trained
    if not dry_run:
        from dtlaunch.hub.dataset import pin_dataset
        from dtlaunch.hub.download import check_cached

        check_cached(job.cfg)  # nodes read a hub model from the cache, never all download it at once
        pin_dataset(job.cfg)  # a hub dataset: fetched here on the login node, its commit in config.yaml
    if job.cfg.cluster.kind != "slurm":
        from dtlaunch.commands.submit_remote import submit_remote

        return submit_remote(job, dry_run)
    out = console()
    if dry_run:
        run_dir = run_dir_for(job.cfg, job.recipe).resolve()
        # The script alone on stdout, so `dtlaunch submit ... --dry-run > job.sbatch` gives a usable file.
        print(slurm.render_script(job.cfg, run_dir, job.cfg.run.name or run_dir.name), end="")
        return 0

    from dtlaunch.data.run_data import prepare_run_data
    from dtlaunch.launch.rundir import create_run_dir

    out.print(summary_table(job))
    # Check the script renders (bad values fail here) before creating anything.
    slurm.render_script(job.cfg, run_dir_for(job.cfg, job.recipe).resolve())
    run_dir = create_run_dir(job.cfg, job.recipe)
    prepare_run_data(job.cfg, run_dir)
    job_id = slurm.submit(job, run_dir)
    out.print(f"submitted job {job_id}", markup=False)
    out.print(f"run directory: {run_dir}", markup=False)
    out.print(f"follow it with: dtlaunch status {run_dir}", markup=False)
    return 0


def resolve_run(run: str, root: str = "runs") -> Path:
    """A run directory given as a path, or as a name under ./runs."""
    for cand in (Path(run), Path(root) / run):
        if cand.is_dir():
            return cand.resolve()
    raise InputError(f"run '{run}' not found: give a run directory or a name under {root}/")


def status_command(run: str, as_json: bool) -> int:
    import json

    from dtlaunch.launch import slurm

    run_dir = resolve_run(run)
    st = slurm.status(run_dir)
    last_step = _last_step(run_dir)
    if as_json:
        print(json.dumps({**st.as_dict(), "run_dir": str(run_dir), "last_step": last_step}))
        return 0
    line = f"job {st.job_id}: {st.state}"
    if st.reason and st.reason != "None":
        line += f" ({st.reason})"
    if st.exit_code:
        line += f", exit {st.exit_code}"
    if st.restarts:
        line += f", requeued {st.restarts}x"
    if st.nodes and st.nodes != "(null)":
        line += f", nodes {st.nodes}"
    if last_step is not None:
        line += f", last logged step {last_step}"
    print(line)
    return 0


def _last_step(run_dir: Path) -> int | None:
    """The newest step in metrics.jsonl (the run's own view of its progress)."""
    import json

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    step = None
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return step
