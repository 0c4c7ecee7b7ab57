"""`train`: compose -> validate -> plan gate -> run directory -> torchrun workers."""

from __future__ import annotations

from typing import Sequence

from dtlaunch.commands.common import console, load_job, summary_table


def train_command(overrides: Sequence[str], recipe_dirs: Sequence[str], dry_run: bool, force: bool,
                  no_resume: bool) -> int:
    job = load_job(overrides, recipe_dirs)
    out = console()
    out.print(summary_table(job))
    if dry_run:
        from omegaconf import OmegaConf

        out.print(OmegaConf.to_yaml(job.cfg), markup=False)
        return 0
    raise NotImplementedError("launch")
