"""`validate`, `config` and `recipes`: look at a job without running anything."""

from __future__ import annotations

from typing import Sequence

from dtlaunch.commands.common import console, load_job, summary_table
from dtlaunch.errors import DtlaunchError


def validate_command(overrides: Sequence[str], recipe_dirs: Sequence[str]) -> int:
    job = load_job(overrides, recipe_dirs)
    out = console()
    out.print(summary_table(job))
    out.print("[green]valid[/green]")
    return 0


def config_command(overrides: Sequence[str], recipe_dirs: Sequence[str], resolve: bool) -> int:
    from omegaconf import OmegaConf

    from dtlaunch.config.compose import compose

    composed = compose(overrides, recipe_dirs)
    print(OmegaConf.to_yaml(composed.cfg) if resolve else composed.unresolved_yaml, end="")
    return 0


def recipes_command(recipe_dirs: Sequence[str]) -> int:
    from rich.table import Table

    from dtlaunch.config.compose import list_recipes
    from dtlaunch.models.shapes import human_count, param_count

    t = Table(title="recipes")
    for col in ("name", "model", "params", "strategy", "world", "hardware", "status"):
        t.add_column(col)
    for name, path in list_recipes(recipe_dirs).items():
        try:
            job = load_job([f"recipe={path}"])
        except DtlaunchError as exc:
            t.add_row(name, "", "", "", "", "", f"[red]invalid: {exc}[/red]")
            continue
        cfg, lay = job.cfg, job.layout
        strategy = job.composed.choices.get("strategy", "")
        t.add_row(
            name,
            cfg.model.name,
            human_count(param_count(cfg.model)),
            f"{strategy} (zero {cfg.strategy.zero_stage}, tp {lay.tp}, pp {lay.pp})",
            str(lay.world),
            cfg.hardware.name,
            "ok",
        )
    console().print(t)
    return 0
