"""`recipes`: list the recipes (with whether each one's memory plan fits its hardware), show one, copy one.

A copied recipe is an ordinary YAML file: edit it and run it with `recipe=./NAME.yaml`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from dtlaunch.commands.common import console, load_job
from dtlaunch.errors import ConfigError, DtlaunchError, InputError


def _recipe_file(name: str, recipe_dirs: Sequence[str]) -> Path:
    from dtlaunch.job.compose import did_you_mean, list_recipes

    recipes = list_recipes(recipe_dirs)
    if name not in recipes:
        raise ConfigError(f"unknown recipe '{name}'{did_you_mean(name, recipes)}: see `dtlaunch recipes` for the list")
    return recipes[name]


def recipe_rows(recipe_dirs: Sequence[str]) -> list[list[str]]:
    """name, model, layout, hardware, plan verdict for every recipe (each one composed and planned)."""
    from dtlaunch.job.compose import list_recipes
    from dtlaunch.models.shapes import human_count, param_count
    from dtlaunch.plan.memory import plan_memory
    from dtlaunch.plan.report import gib

    rows: list[list[str]] = []
    for name, path in list_recipes(recipe_dirs).items():
        try:
            job = load_job([f"recipe={path}"])
        except DtlaunchError as exc:
            rows.append([name, "", "", "", f"[red]invalid: {exc}[/red]"])
            continue
        cfg, lay = job.cfg, job.layout
        strategy = job.composed.choices.get("strategy", "")
        # The analytic planner (no torch): the status says whether `train` would pass the memory gate.
        plan = plan_memory(cfg, lay)
        need = f"{gib(plan.device_total)} of {gib(plan.capacity)}"
        rows.append(
            [
                name,
                f"{cfg.model.name} ({human_count(param_count(cfg.model))})",
                f"{strategy} on {lay.world}: zero{cfg.strategy.zero_stage} tp{lay.tp} pp{lay.pp}",
                cfg.hardware.name,
                f"[green]fits[/green] {need}" if plan.fits else f"[red]does not fit[/red] {need}",
            ]
        )
    return rows


def recipes_table(rows: list[list[str]], width: int) -> Any:
    """The rows fitted to `width`: the name never wraps or is cut, the other columns wrap first."""
    from dtlaunch.report.tables import plain_table

    headers = ["name", "model", "layout", "hardware", "plan (GiB)"]
    t = plain_table(headers, rows, width, title="recipes", keep_whole=(0,))
    # A name is what the user types: never folded, whatever the width.
    t.columns[0].no_wrap = True
    return t


def recipes_command(recipe_dirs: Sequence[str]) -> int:
    out = console()
    out.print(recipes_table(recipe_rows(recipe_dirs), out.width))
    return 0


def show_command(name: str, recipe_dirs: Sequence[str]) -> int:
    path = _recipe_file(name, recipe_dirs)
    print(f"# {path}")
    print(path.read_text(), end="")
    return 0


def cp_command(name: str, dest: Optional[str], force: bool, recipe_dirs: Sequence[str]) -> int:
    src = _recipe_file(name, recipe_dirs)
    target = Path(dest) if dest else Path(f"{name}.yaml")
    if target.is_dir():
        target = target / f"{name}.yaml"
    elif target.suffix not in (".yaml", ".yml"):
        # `recipe=` takes a path only when it ends in .yaml, so the copy gets that suffix.
        target = target.with_name(target.name + ".yaml")
    if target.exists() and not force:
        raise InputError(f"'{target}' already exists: pass --force to overwrite it, or give another DEST")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    except OSError as exc:
        raise InputError(f"cannot write '{target}': {exc.strerror}") from exc
    shown = str(target) if target.is_absolute() or str(target).startswith(".") else f"./{target}"
    print(f"copied recipe '{name}' to {target}; edit it, then: dtlaunch train recipe={shown}")
    return 0
