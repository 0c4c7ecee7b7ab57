"""`validate` and `config`: look at a job without running anything."""

from __future__ import annotations

from typing import Sequence

from dtlaunch.commands.common import console, load_job, summary_table


def validate_command(overrides: Sequence[str], recipe_dirs: Sequence[str]) -> int:
    job = load_job(overrides, recipe_dirs, to_run=True)
    out = console()
    out.print(summary_table(job))
    out.print("[green]valid[/green]")
    return 0


def config_command(overrides: Sequence[str], recipe_dirs: Sequence[str], resolve: bool) -> int:
    from omegaconf import OmegaConf

    from dtlaunch.job.compose import compose

    composed = compose(overrides, recipe_dirs)
    print(OmegaConf.to_yaml(composed.cfg) if resolve else composed.unresolved_yaml, end="")
    return 0


def cfg_flag_command(what: str, overrides: Sequence[str], recipe_dirs: Sequence[str]) -> int:
    """Hydra's `--cfg job` habit: the composed config, as `dtlaunch config` prints it."""
    from dtlaunch.errors import ConfigError

    if what not in ("job", "all"):
        raise ConfigError(f"--cfg {what}: dtlaunch has only the job config; use --cfg job (or `dtlaunch config`)")
    return config_command(overrides, recipe_dirs, resolve=False)
