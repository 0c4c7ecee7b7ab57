"""`submit` and `status`: run a job on Slurm, and look at it later.

submit: compose -> validate -> plan gate -> run directory (+ data, prepared once here on the login node)
-> sbatch script -> sbatch (with training.eval_tasks, the evaluation's script too, as a second job held until
training succeeded). The job ids are kept in run_dir/slurm.json so `status RUN` can find them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dtlaunch.commands.common import Job, console, load_job, summary_table
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.run.run_dir import METRICS_NAME

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.launch.slurm import JobStatus


def _plan_gate(job: Job, force: bool, to_stderr: bool) -> None:
    """The planner's gate (prints the plan; raises PlanDoesNotFit, exit 3), when the planner provides one, and
    the choices the job left to the plan written into it: the nodes' workers read the run directory's
    config.yaml and must run the job as it was planned."""
    import contextlib
    import sys

    try:
        from dtlaunch.commands.plan import plan_gate, take_plan_choices
    except ImportError:
        return
    # A dry run keeps stdout for the script alone (`dtlaunch submit ... --dry-run > job.sbatch`).
    with contextlib.redirect_stdout(sys.stderr) if to_stderr else contextlib.nullcontext():
        take_plan_choices(job, plan_gate(job, force=force))


def submit_command(overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool) -> int:
    from dtlaunch.launch import slurm, slurm_script
    from dtlaunch.launch.rundir import run_dir_for

    job = load_job(overrides, recipe_dirs, to_run=True)
    if job.cfg.cluster.kind not in ("slurm", "kubernetes", "skypilot"):
        raise ConfigError(
            f"cluster.kind='{job.cfg.cluster.kind}' cannot be submitted: add cluster=slurm, kubernetes or skypilot"
        )
    _plan_gate(job, force, to_stderr=dry_run)
    if not dry_run:
        from dtlaunch.launch.job_inputs import check_training_weights

        check_training_weights(job.cfg, fetch=False)  # a local hf:DIR must hold its weights, not only config.json
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
        print(slurm_script.render_script(job.cfg, run_dir, job.cfg.run.name or run_dir.name), end="")
        _print_eval_script(job.cfg, run_dir)
        return 0

    from dtlaunch.launch.run_data import prepare_run_data
    from dtlaunch.launch.rundir import create_run_dir, pin_run_dir, removed_if_failed

    out.print(summary_table(job))
    run_dir = pin_run_dir(job.cfg, job.recipe)
    # Check the script renders (bad values fail here) before creating anything.
    slurm_script.render_script(job.cfg, run_dir)
    with removed_if_failed(run_dir):  # bad data or a refused sbatch: no new run directory stays behind
        create_run_dir(job.cfg, job.recipe)
        prepare_run_data(job.cfg, run_dir)
        sub = slurm.submit(job, run_dir)
    out.print(f"submitted job {sub.job_id}", markup=False)
    if sub.eval_job_id:
        out.print(
            f"submitted evaluation job {sub.eval_job_id} (training.eval_tasks; starts once job {sub.job_id} "
            f"has succeeded; cluster.eval_time={job.cfg.cluster.eval_time or 'the partition default'})",
            markup=False,
            soft_wrap=True,  # one line, for people and for scripts that read the id
        )
    out.print(f"run directory: {run_dir}", markup=False)
    out.print(f"follow it with: dtlaunch status {run_dir}", markup=False)
    return 0


def _print_eval_script(cfg: JobConfig, run_dir: Path) -> None:
    """A dry run with training.eval_tasks: the evaluation job's script on stderr (stdout keeps the training
    script alone)."""
    import sys

    from dtlaunch.launch.slurm_script import EVAL_SCRIPT_NAME, render_eval_script, wants_eval_job

    if not wants_eval_job(cfg):
        return
    print(
        f"# training.eval_tasks: also submitted, as run_dir/{EVAL_SCRIPT_NAME} with "
        f"`sbatch --dependency=afterok:<training job id>`:",
        file=sys.stderr,
    )
    print(render_eval_script(cfg, run_dir, cfg.run.name or run_dir.name), end="", file=sys.stderr)


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
    ev = slurm.eval_status(run_dir)
    last_step = _last_step(run_dir)
    if as_json:
        record = {**st.as_dict(), "run_dir": str(run_dir), "last_step": last_step}
        print(json.dumps({**record, "eval_job": ev.as_dict() if ev else None}))
        return 0
    print(_status_line(st, "job") + (f", last logged step {last_step}" if last_step is not None else ""))
    if ev is not None:
        print(_status_line(ev, "evaluation job") + f", log {run_dir / 'logs' / f'slurm-{ev.job_id}.out'}")
    return 0


def _status_line(st: JobStatus, what: str) -> str:
    line = f"{what} {st.job_id}: {st.state}"
    if st.reason and st.reason != "None":
        line += f" ({st.reason})"
    if st.exit_code:
        line += f", exit {st.exit_code}"
    if st.restarts:
        line += f", requeued {st.restarts}x"
    if st.nodes and st.nodes != "(null)":
        line += f", nodes {st.nodes}"
    return line


def _last_step(run_dir: Path) -> int | None:
    """The newest step in metrics.jsonl (the run's own view of its progress)."""
    import json

    path = run_dir / METRICS_NAME
    if not path.is_file():
        return None
    step = None
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return step
