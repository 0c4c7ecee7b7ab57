"""`train`: compose -> validate -> plan gate -> run directory -> torchrun workers."""

from __future__ import annotations

import json
import os
from typing import Sequence

from dtlaunch.commands.common import console, load_job, summary_table
from dtlaunch.errors import EXIT_PLAN_DOES_NOT_FIT


def train_command(
    overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool, no_resume: bool
) -> int:
    job = load_job(overrides, recipe_dirs)
    # The memory-plan gate refuses (exit 3) before anything is created, unless --force.
    from dtlaunch.commands.plan import plan_gate

    plan = plan_gate(job, force=force or dry_run)
    out = console()
    out.print(summary_table(job))

    from dtlaunch.launch.local import launch_command, launch_local
    from dtlaunch.launch.rundir import run_dir_for

    if dry_run:
        from omegaconf import OmegaConf

        out.print(OmegaConf.to_yaml(job.cfg), markup=False)
        run_dir = run_dir_for(job.cfg, job.recipe).resolve()
        out.print("launch command:", style="bold")
        # Plain print, not rich: the shell-quoted line must reach the terminal byte for byte (rich would
        # wrap it or turn `:name:` into emoji), so that pasting it runs exactly the launch.
        out.file.flush()
        print(launch_command(job.cfg, run_dir), flush=True)
        return 0 if plan.fits else EXIT_PLAN_DOES_NOT_FIT

    from dtlaunch.launch.rundir import create_run_dir
    from dtlaunch.train.checkpoint import NO_RESUME_ENV, refuse_if_checkpoints
    from dtlaunch.train.data import prepare_run_data

    if no_resume:
        # Refuse before the run directory is touched; workers inherit the variable and
        # CheckpointManager.resume() refuses too (a directory that gains checkpoints meanwhile).
        refuse_if_checkpoints(job.cfg, run_dir_for(job.cfg, job.recipe).resolve())
        os.environ[NO_RESUME_ENV] = "1"
    run_dir = create_run_dir(job.cfg, job.recipe)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    out.print(f"run directory: {run_dir}", markup=False)
    prepare_run_data(job.cfg, run_dir)
    # Data sample and the checkpoint to resume, checked before any worker starts (exit 2 here, not 1 there).
    from dtlaunch.launch.preflight import check_data, check_resume

    check_data(job.cfg, run_dir, job.layout)
    check_resume(job.cfg, run_dir, say=lambda msg: out.print(msg, markup=False))
    launch_local(job.cfg, run_dir)
    return 0
