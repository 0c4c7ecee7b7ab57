"""Shared steps of the commands: compose + validate once, and the console rank 0 prints to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.job.compose import Composed, compose
from dtlaunch.job.validate import validate


@dataclass
class Job:
    """A composed, validated job: the single input of plan, launch and submit."""

    composed: Composed
    decisions: Decisions  # validate's: the planner, the summary and the launcher read these
    notes: list[str]

    @property
    def layout(self) -> Layout:
        return self.decisions.layout

    @property
    def cfg(self) -> Any:
        return self.composed.cfg

    @property
    def recipe(self) -> str:
        return self.composed.choices.get("recipe", "") or "custom"


def load_job(overrides: Sequence[str], recipe_dirs: Sequence[str] = (), to_run: bool = False) -> Job:
    """Compose, apply the config rules and check the job's inputs. `to_run`: validate, train and submit
    (dry run or not) check that it can run, not only be planned (dtlaunch.launch.job_inputs.check_job_inputs)."""
    composed = compose(overrides, recipe_dirs)
    v = validate(composed.cfg)
    from dtlaunch.launch.job_inputs import check_job_inputs

    check_job_inputs(composed.cfg, to_run)  # the files the job names, before anything runs
    return Job(composed=composed, decisions=v.decisions, notes=v.notes)


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def summary_table(job: Job) -> Any:
    """The resolved job at a glance: what runs where, with the batch arithmetic spelled out."""
    from rich.table import Table

    from dtlaunch.models.shapes import human_count, param_count

    cfg, lay = job.cfg, job.layout
    t = Table(title=f"job: {job.recipe}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{cfg.model.name} ({human_count(param_count(cfg.model))} params, model.arch={cfg.model.arch})")
    from dtlaunch.job.hf_model import describe_hf_source

    loaded = describe_hf_source(cfg)
    if loaded:
        t.add_row("weights", loaded)
    t.add_row(
        "layout",
        f"world {lay.world} = dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x "
        f"{f'cp {lay.cp} x ' if lay.cp > 1 else ''}tp {lay.tp} x pp {lay.pp}; zero_stage {cfg.strategy.zero_stage}"
        + (f"; expert parallel {lay.ep} (of dp_shard)" if lay.ep > 1 else ""),
    )
    gb, accum = job.decisions.global_batch, job.decisions.grad_accum
    t.add_row(
        "batch",
        f"{cfg.training.micro_batch} micro x {lay.dp} dp x {accum} accum = {gb} samples "
        f"x {cfg.training.seq_len} tokens = {gb * cfg.training.seq_len:,} tokens/step",
    )
    t.add_row(
        "precision",
        f"params {cfg.precision.param_dtype}, reduce {cfg.precision.reduce_dtype}; "
        f"AC {cfg.training.activation_checkpointing}; compile {cfg.training.compile}"
        + ("; activations offloaded" if job.decisions.activation_offload else "")
        + ("; FSDP CPU offload" if cfg.strategy.cpu_offload else ""),
    )
    t.add_row("hardware", f"{cfg.hardware.name} ({cfg.hardware.memory_gib} GiB)")
    t.add_row("data", f"{cfg.data.kind} {cfg.data.path}".strip())
    for note in job.notes:
        t.add_row("note", note)
    return t
