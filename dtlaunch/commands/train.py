"""`train`: compose -> validate -> plan gate -> run directory -> torchrun workers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from dtlaunch.commands.common import console, load_job, summary_table
from dtlaunch.errors import EXIT_PLAN_DOES_NOT_FIT
from dtlaunch.launch.warm_start import Prepared

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def train_command(
    overrides: Sequence[str],
    recipe_dirs: Sequence[str],
    dry_run: bool,
    force: bool,
    no_resume: bool,
    report: Optional[Callable[[BaseException], int]] = None,
) -> int:
    """`report` prints an error the CLI's way and returns its exit code: given it, the preparation may
    run in a forked child while this process imports torch's agent (dtlaunch.launch.warm_start)."""
    if dry_run:
        return _dry_run(overrides, recipe_dirs)
    from dtlaunch.launch.warm_start import overlap_possible, prepare_aside

    def prepare() -> Prepared:
        return prepare_launch(overrides, recipe_dirs, force, no_resume)

    if report is not None and overlap_possible():
        prepared, code = prepare_aside(prepare, report, exit_at_once=True)
        if prepared is None:
            return code
        from dtlaunch.job.compose import typed_resolved

        prepared.cfg = typed_resolved(prepared.cfg)  # it crossed the fork as a plain container
    else:
        prepared = prepare()
    return launch_prepared(prepared)


def _dry_run(overrides: Sequence[str], recipe_dirs: Sequence[str]) -> int:
    """Print the plan, the summary, the config and the launch command; create and start nothing."""
    job, plan = _compose_and_plan(overrides, recipe_dirs, force=True)
    from omegaconf import OmegaConf

    from dtlaunch.launch.local import launch_command
    from dtlaunch.launch.rundir import run_dir_for

    out = console()
    out.print(OmegaConf.to_yaml(job.cfg), markup=False)
    run_dir = run_dir_for(job.cfg, job.recipe).resolve()
    out.print("launch command:", style="bold")
    # Plain print, not rich: the shell-quoted line must reach the terminal byte for byte (rich would
    # wrap it or turn `:name:` into emoji), so that pasting it runs exactly the launch.
    out.file.flush()
    print(launch_command(job.cfg, run_dir), flush=True)
    return 0 if plan.fits else EXIT_PLAN_DOES_NOT_FIT


def _compose_and_plan(overrides: Sequence[str], recipe_dirs: Sequence[str], force: bool) -> tuple[Any, Any]:
    from dtlaunch.run.phases import phase

    phase("composing the job")
    job = load_job(overrides, recipe_dirs, to_run=True)
    # The memory-plan gate refuses (exit 3) before anything is created, unless --force.
    from dtlaunch.commands.plan import plan_gate, take_plan_choices

    phase("planning memory")
    plan = plan_gate(job, force=force)
    take_plan_choices(job, plan)
    console().print(summary_table(job))
    return job, plan


def prepare_launch(overrides: Sequence[str], recipe_dirs: Sequence[str], force: bool, no_resume: bool) -> Prepared:
    """Everything before the workers start: compose, validate, plan gate, run directory, data, checks."""
    job, plan = _compose_and_plan(overrides, recipe_dirs, force)
    check_hf_weights(job.cfg)
    from dtlaunch.commands.eval import check_eval_runs_here

    check_eval_runs_here(job.cfg)  # training.eval_tasks: lm-eval and its datasets usable here, before training
    from dtlaunch.hub.dataset import pin_dataset

    pin_dataset(job.cfg)  # a hub dataset: fetched now and its commit recorded in config.yaml
    from dtlaunch.launch.rundir import pin_run_dir, removed_if_failed

    run_dir = pin_run_dir(job.cfg, job.recipe)
    lock_fd = -1
    try:
        with removed_if_failed(run_dir):  # a new directory goes again, while this launcher still holds its lock
            # Before anything in the run directory changes: one launcher per run directory (exit 2 naming the other).
            lock_fd = _lock_run_dir(job.cfg, run_dir)
            _prepare_run_dir(job, plan, no_resume, run_dir)
    except BaseException:
        if lock_fd >= 0:  # an in-process caller goes on: a failed preparation must not keep the lock
            os.close(lock_fd)
        raise
    return Prepared(run_dir=str(run_dir), layout=job.layout, recipe=job.recipe, cfg=job.cfg, lock_fd=lock_fd)


def _prepare_run_dir(job: Any, plan: Any, no_resume: bool, run_dir: Path) -> None:
    """The run directory with its config, plan and data, checked: the data sample and the checkpoint to
    resume (exit 2 here, not 1 in the workers)."""
    from dtlaunch.launch.local import follows_node_0
    from dtlaunch.launch.preflight import check_data, check_resume
    from dtlaunch.launch.run_data import prepare_run_data
    from dtlaunch.launch.rundir import create_run_dir, move_checkpoints_aside
    from dtlaunch.run.env import NO_RESUME_ENV

    out = console()
    if follows_node_0(job.cfg.launch):
        # Node 0's launcher writes, checks and (--no-resume) clears the shared run directory; were this one
        # to write its config too, the two launchers would displace each other's config.yaml.
        if no_resume:
            os.environ[NO_RESUME_ENV] = "1"
        create_run_dir(job.cfg, job.recipe)
        out.print(f"run directory: {run_dir} (node 0 prepares it)", markup=False)
        prepare_run_data(job.cfg, run_dir)
        return
    if no_resume:
        # Start fresh, keeping the old checkpoints under a new name. Workers inherit the variable and
        # CheckpointManager.resume() refuses a directory that gains checkpoints meanwhile.
        moved = move_checkpoints_aside(job.cfg, run_dir)
        if moved is not None:
            out.print(f"--no-resume: moved the old checkpoints to {moved}; starting from step 1", markup=False)
        os.environ[NO_RESUME_ENV] = "1"
    create_run_dir(job.cfg, job.recipe)  # the pinned run directory
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    out.print(f"run directory: {run_dir}", markup=False)
    prepare_run_data(job.cfg, run_dir)
    check_data(job.cfg, run_dir, job.layout)
    check_resume(job.cfg, run_dir, say=lambda msg: out.print(msg, markup=False))


def _lock_run_dir(cfg: JobConfig, run_dir: Path) -> int:
    """The run directory's lock (-1: not this launcher's to take). Of a multi-node run only node 0 takes
    it: the others share its directory, and its rendezvous refuses a second job under the same id."""
    from dtlaunch.launch.local import node_rank_of
    from dtlaunch.launch.runlock import lock_run_dir

    if int(cfg.launch.nnodes) > 1 and node_rank_of(cfg.launch) != 0:
        return -1
    return lock_run_dir(run_dir)


def launch_prepared(prepared: Prepared) -> int:
    """Start the workers on this node, wait for them, then print the run's summary."""
    from dtlaunch.config.layout import nproc_per_node
    from dtlaunch.launch.local import node_rank_of
    from dtlaunch.launch.summary import complete_summary, summary_lines
    from dtlaunch.run.phases import phase

    cfg, run_dir = prepared.cfg, Path(prepared.run_dir)
    out = console()
    phase(f"starting {nproc_per_node(cfg)} worker(s) on this node")
    began = time.perf_counter()
    if prepared.lock_fd >= 0:
        from dtlaunch.launch.runlock import record_holder

        record_holder(prepared.lock_fd)
    try:
        _launch_recording_state(cfg, run_dir)
    finally:
        if prepared.lock_fd >= 0:  # the job is over: the run directory is free for the next launcher
            os.close(prepared.lock_fd)
    summary = complete_summary(cfg, prepared.layout, run_dir, time.perf_counter() - began)
    for line in summary_lines(summary, run_dir) if summary else []:
        out.print(line, markup=False, soft_wrap=True)
    if cfg.profiling.enabled:
        from dtlaunch.report.breakdown import breakdown_lines, write_profile_summary

        for line in breakdown_lines(write_profile_summary(run_dir), run_dir):
            out.print(line, markup=False, soft_wrap=True)
    if cfg.training.eval_tasks and node_rank_of(cfg.launch) <= 0:  # node 0 (or the only node) evaluates
        from dtlaunch.commands.eval import eval_after_training

        eval_after_training(cfg, run_dir)
    return 0


def check_hf_weights(cfg: JobConfig) -> None:
    """The weights training starts from, before a run directory is created (dtlaunch.launch.job_inputs)."""
    from dtlaunch.launch.job_inputs import check_training_weights

    check_training_weights(cfg, fetch=True)


def _launch_recording_state(cfg: JobConfig, run_dir: Path) -> None:
    """launch_local, with RUN/state.json saying what happened (read by `dtlaunch status`)."""
    from dtlaunch.errors import Preempted
    from dtlaunch.launch.local import launch_local, node_rank_of
    from dtlaunch.launch.runstate import record_state

    if int(cfg.launch.nnodes) > 1 and node_rank_of(cfg.launch) > 0:
        launch_local(cfg, run_dir)  # node 0's launcher speaks for a multi-node run
        return
    record_state(run_dir, "running", total_steps=int(cfg.training.steps))
    try:
        launch_local(cfg, run_dir)
    except Preempted as exc:
        record_state(run_dir, "preempted", error=str(exc))
        raise
    except KeyboardInterrupt:
        record_state(run_dir, "interrupted")
        raise
    except BaseException as exc:
        record_state(run_dir, "failed", error=str(exc) or type(exc).__name__)
        raise
    record_state(run_dir, "finished")
