"""`plan`: the per-rank memory plan, fix suggestions, layout search; and the gate `train` uses."""

from __future__ import annotations

import json
import shlex
from typing import Any, Sequence

from dtlaunch.commands.common import Job, console, load_job
from dtlaunch.errors import PlanDoesNotFit
from dtlaunch.plan.memory import MemoryPlan, plan_memory


def make_plan(job: Job) -> MemoryPlan:
    """The plan with notes and, when it does not fit, validated fix suggestions."""
    plan = plan_memory(job.cfg, job.layout)
    plan.notes = list(job.notes) + plan.notes
    if not plan.fits and plan.worst.phase not in ("traced", "untraced"):
        from dtlaunch.plan.suggest import suggest

        plan.suggestions = suggest(job.cfg, job.layout)
    return plan


def print_plan(plan: MemoryPlan, out: Any) -> None:
    from dtlaunch.plan.report import host_table, plan_table, suggestions_table, verdict_line

    out.print(plan_table(plan))
    if plan.host_per_rank:
        out.print(host_table(plan))
    if plan.worst.phase == "traced":
        from dtlaunch.plan.memory import TRACED_NOTE

        out.print(TRACED_NOTE, markup=False, soft_wrap=True)
    for note in plan.notes:  # what validation and the plan chose for the user (e.g. how generation gathers)
        out.print(f"note: {note}", markup=False)  # wrapped to the terminal: notes can be long
    out.print(verdict_line(plan))
    if plan.suggestions:
        out.print(suggestions_table(plan.suggestions))


def plan_gate(job: Job, force: bool) -> MemoryPlan:
    """Used by `dtlaunch train`: print the plan; refuse (exit 3) when it does not fit unless --force."""
    plan = make_plan(job)
    print_plan(plan, console())
    if not plan.fits and not force:
        raise PlanDoesNotFit(_refusal(plan))
    return plan


def take_plan_choices(job: Job, plan: MemoryPlan) -> None:
    """What the plan chose where the job left it to the plan (objective.generation_gather=auto under ZeRO-3:
    "unit" when only that fits; training.loss_chunks=auto on a GPU profile: 1 when the full pass fits) goes
    into the config the run directory's config.yaml is written from, so that the workers run as it was
    planned, and into the job's decisions, which must stay the config's."""
    import dataclasses

    if plan.generation_gather and str(job.cfg.objective.generation_gather) == "auto":
        job.cfg.objective.generation_gather = plan.generation_gather
        job.decisions = dataclasses.replace(job.decisions, generation_gather=plan.generation_gather)
    if plan.loss_chunks and int(job.cfg.training.loss_chunks) == 0:  # training.loss_chunks=auto: the full pass fits
        job.cfg.training.loss_chunks = plan.loss_chunks
        job.decisions = dataclasses.replace(job.decisions, loss_chunks=plan.loss_chunks)


def _refusal(plan: MemoryPlan) -> str:
    from dtlaunch.plan.report import gib, host_overflow

    if plan.unplanned:
        return f"no memory plan on this host: {plan.unplanned}; or pass --force to launch it unplanned"
    if plan.headroom >= 0 and not plan.host_fits:
        return f"the plan does not fit host RAM: {host_overflow(plan)}; offload less or pass --force"
    msg = (
        f"the plan does not fit: {gib(plan.device_total)} GiB per GPU needed on {plan.hardware} "
        f"({gib(plan.capacity)} GiB), peak in {plan.worst.phase} on stage {plan.worst.stage}"
    )
    if plan.suggestions:
        best = plan.suggestions[0]
        msg += f"; try {shlex.join(best['overrides'])} ({best['change']}, {gib(best['device_total_bytes'])} GiB)"
    return msg + "; or pass --force"


def plan_command(
    overrides: Sequence[str],
    recipe_dirs: Sequence[str],
    as_json: bool = False,
    search: bool = False,
    top: int = 10,
    trace: bool = False,
) -> int:
    job = load_job(overrides, recipe_dirs)
    plan = make_plan(job)
    data = plan.to_dict()
    rows: list[dict] = []
    if search:
        from dtlaunch.plan.search import search as run_search

        rows = run_search(job.cfg, top)
        data["search"] = [{k: v for k, v in r.items() if k != "times"} for r in rows]
    if trace:
        data["trace"] = _trace(job, plan)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0 if plan.fits else 3
    out = console()
    from dtlaunch.job.hf_model import describe_hf_source

    loaded = describe_hf_source(job.cfg)
    if loaded:
        out.print(loaded, markup=False, soft_wrap=True)  # config.json only: no weights are read to plan
    print_plan(plan, out)
    if search:
        from dtlaunch.plan.report import search_table

        out.print(search_table(rows, out.width) if rows else "[red]no layout fits this GPU count[/red]")
        if rows:
            out.print("best layout as overrides: " + shlex.join(rows[0]["overrides"]), markup=False)
    if trace and "skipped" in data["trace"]:
        out.print(f"--trace skipped: {data['trace']['skipped']}", markup=False, soft_wrap=True)
    elif trace:
        from dtlaunch.plan.report import trace_table

        out.print(trace_table(data["trace"]))  # the whole record: --json
    return 0 if plan.fits else 3


def _trace(job: Job, plan: MemoryPlan) -> dict:
    """The traced second opinion next to the analytic figure of the same stage, or {"skipped": why} where
    this machine cannot trace the job (the analytic plan stands; the command still succeeds)."""
    from dtlaunch.plan.trace import skip_reason, trace_peak

    reason = skip_reason(job.cfg, job.layout)
    if reason:
        return {"skipped": reason}
    # The most loaded pipeline stage's first rank (pp is the outermost mesh dimension).
    traced = trace_peak(job.cfg, job.layout, rank=plan.worst.stage * (job.layout.world // job.layout.pp))
    stage = next(sp for sp in plan.stages if sp.stage == traced["stage"])
    # The trace runs in one memory (CPU): what offloading would keep on the host is in its figure too.
    traced["analytic_peak_bytes"] = int(stage.peak + stage.host_peak)
    traced["analytic_categories"] = {k: int(v) for k, v in {**stage.lines, **stage.host}.items()}
    traced["error_pct"] = round(
        (traced["analytic_peak_bytes"] - traced["peak_bytes"]) / max(1, traced["peak_bytes"]) * 100, 2
    )
    return traced


def maximize_command(overrides: Sequence[str], recipe_dirs: Sequence[str], key: str, as_json: bool = False) -> int:
    """`plan --maximize KEY`: the largest value that fits and its override; exit 3 when none does."""
    from dtlaunch.plan.maximize import maximize
    from dtlaunch.plan.report import gib

    job = load_job(overrides, recipe_dirs)
    # What the command line sets stays as set; the savers it leaves open are the search's to turn on.
    found = maximize(job.cfg, key, pinned={o.split("=", 1)[0].lstrip("+~") for o in overrides})
    if as_json:
        data = {"key": key, "value": found.value, "override": found.override if found.value else None}
        data["savers"] = list(found.savers)
        if found.plan is not None:
            data["device_total_bytes"] = int(found.plan.device_total)
        print(json.dumps(data, indent=2))
        return 0 if found.value else 3
    if found.value is None:
        console().print(f"nothing fits: even {key}={found.smallest} does not fit {job.cfg.hardware.name}", markup=False)
        return 3
    p = found.plan
    console().print(
        f"largest {key} that fits: {found.value} ({gib(p.device_total)} of {gib(p.capacity)} GiB per GPU"
        + (f", {gib(p.host_total)} of {gib(p.host_capacity)} GiB host RAM per node" if p.host_per_rank else "")
        + ")",
        markup=False,
    )
    if found.value == found.largest:
        cap = {
            "training.seq_len": "model.max_seq_len",
            "objective.max_completion_length": "model.max_seq_len less the prompts' room",
            "objective.num_generations": "the search's cap on completions per prompt",
        }.get(key, "training.global_batch / data-parallel ranks")
        console().print(f"(the largest value allowed: {cap} caps {key} at {found.largest})", markup=False)
    if found.savers:
        console().print(
            f"savers turned on (the cheapest that reach it; pinned here): {' '.join(found.savers)}", markup=False
        )
    console().print(f"override to paste: {' '.join((found.override, *found.savers))}", markup=False)
    return 0
