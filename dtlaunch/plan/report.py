"""Rich tables for a memory plan and a layout search."""

from __future__ import annotations

import shlex
from typing import Any

from dtlaunch.plan.memory import GIB, MemoryPlan


def gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def plan_table(plan: MemoryPlan) -> Any:
    from rich.table import Table

    w = plan.worst
    lay = plan.layout
    title = (
        f"memory plan: {plan.recipe} on {plan.hardware} — world {lay['world']} = dp_replicate "
        f"{lay['dp_replicate']} x dp_shard {lay['dp_shard']} x "
        + (f"cp {lay['cp']} x " if lay.get("cp", 1) > 1 else "")
        + f"tp {lay['tp']} x pp {lay['pp']}"
        + (f" (experts: ep {lay['ep']})" if lay.get("ep", 1) > 1 else "")
    )
    t = Table(title=title, title_justify="left")
    t.add_column(f"per rank (most loaded: stage {w.stage}, peak in {w.phase})")
    t.add_column("GiB", justify="right")
    for name, value in w.lines.items():
        if value:
            t.add_row(name, gib(value))
    t.add_row("[bold]peak allocated[/bold]", f"[bold]{gib(plan.peak)}[/bold]")
    for name, value in plan.overheads.items():
        t.add_row(f"+ {name}", gib(value))
    t.add_row("[bold]device total[/bold]", f"[bold]{gib(plan.device_total)}[/bold]")
    t.add_row("capacity", gib(plan.capacity))
    color = "green" if plan.fits else "red"
    t.add_row(f"[{color}]headroom[/{color}]", f"[{color}]{gib(plan.headroom)}[/{color}]")
    if len(plan.stages) > 1:
        # One stage a line: a stage's figure is never split across lines.
        per = "\n".join(f"{s.stage}: {gib(s.peak)} ({s.phase})" for s in plan.stages)
        t.add_row("per stage", per)
    return t


def host_table(plan: MemoryPlan) -> Any:
    """Host RAM: one rank's lines (offloaded bytes, GRPO's tool process), times the ranks of a node, against the
    node's RAM."""
    from rich.table import Table

    t = Table(title="host RAM (offloaded, tool processes)", title_justify="left")
    t.add_column("per rank")
    t.add_column("GiB", justify="right")
    for name, value in plan.worst_host.items():
        if value:
            t.add_row(name, gib(value))
    t.add_row("[bold]per rank[/bold]", f"[bold]{gib(plan.host_per_rank)}[/bold]")
    t.add_row(f"[bold]per node ({plan.host_ranks} ranks)[/bold]", f"[bold]{gib(plan.host_total)}[/bold]")
    if not plan.host_capacity:  # unknown: nothing offloaded (refused then), only GRPO's tool processes
        t.add_row("host capacity (hardware.host_memory_gib)", "unknown")
        return t
    t.add_row("host capacity (hardware.host_memory_gib)", gib(plan.host_capacity))
    color = "green" if plan.host_fits else "red"
    t.add_row(f"[{color}]host headroom[/{color}]", f"[{color}]{gib(plan.host_capacity - plan.host_total)}[/{color}]")
    return t


def host_overflow(plan: MemoryPlan) -> str:
    """The one line saying that a node's host RAM is too small for what its ranks offload."""
    return (
        f"needs {gib(plan.host_total)} GiB of host RAM per node ({plan.host_ranks} ranks x "
        f"{gib(plan.host_per_rank)} GiB offloaded), {plan.hardware} nodes have {gib(plan.host_capacity)} GiB "
        f"(hardware.host_memory_gib)"
    )


def verdict_line(plan: MemoryPlan) -> str:
    if plan.unplanned:
        return f"[yellow]not planned on this host[/yellow] (the figures above are a lower bound): {plan.unplanned}"
    if not plan.host_fits:
        return f"[red]does not fit[/red]: {host_overflow(plan)}"
    if plan.fits:
        return (
            f"[green]fits[/green]: {gib(plan.device_total)} of {gib(plan.capacity)} GiB "
            f"({gib(plan.headroom)} GiB headroom)"
        )
    return (
        f"[red]does not fit[/red]: needs {gib(plan.device_total)} GiB per GPU, {plan.hardware} has "
        f"{gib(plan.capacity)} GiB"
    )


def suggestions_table(suggestions: list[dict]) -> Any:
    from rich.table import Table

    t = Table(title="changes that make it fit (smallest first)", title_justify="left")
    t.add_column("change")
    t.add_column("peak GiB", justify="right")
    t.add_column("overrides to paste")
    for s in suggestions:
        t.add_row(s["change"], gib(s["device_total_bytes"]), shlex.join(s["overrides"]))
    return t


def search_table(rows: list[dict], width: int = 80) -> Any:
    """Few columns of space-separated words, fitted to `width` so that no value is cut (the step time
    is in --json; tokens/s ranks the same for the job's fixed global batch)."""
    from dtlaunch.report.tables import plain_table

    headers = ["#", "layout", "settings", "GiB", "tokens/s", "MFU", "vs #1"]
    body = [
        [
            str(i),
            f"{r['dp_replicate']}x{r['dp_shard']}x{r['tp']}x{r['pp']}"
            + (f" cp{r['cp']}" if r.get("cp", 1) > 1 else "")
            + (f" {r['schedule']}" if r["schedule"] != "-" else ""),
            f"zero{r['zero_stage']} mb{r['micro_batch']} AC {r['ac']}"
            + (f" ep{r['ep']}" if r.get("ep", 1) > 1 else "")
            + (f" loss/{r['loss_chunks']}" if r.get("loss_chunks", 1) > 1 else "")
            + (" cpu-offload" if r.get("cpu_offload") else "")
            + (" act-offload" if r.get("activation_offload") else ""),
            gib(r["device_total_bytes"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu'] * 100:.1f}%",
            r["why"],
        ]
        for i, r in enumerate(rows, 1)
    ]
    title = (
        "layouts that fit, fastest first (layout = dp_replicate x dp_shard x tp x pp, cpN = context parallel "
        "over N ranks, pipeline schedule)"
    )
    return plain_table(headers, body, width, title=title)


def trace_table(traced: dict) -> Any:
    """`plan --trace`: the traced peak by torch's categories, beside the plan's peak of the same stage (the
    two count in different categories: only the totals compare)."""
    from rich.table import Table

    t = Table(
        title=f"traced: stage {traced['stage']}, rank {traced['rank']}, {traced['tensors']} tensors",
        title_justify="left",
    )
    t.add_column("at the traced peak")
    t.add_column("GiB", justify="right")
    for name, value in traced["categories"].items():
        if value:
            t.add_row(name, gib(value))
    t.add_row("[bold]traced peak[/bold]", f"[bold]{gib(traced['peak_bytes'])}[/bold]")
    t.add_row("planned peak (same stage)", gib(traced["analytic_peak_bytes"]))
    t.add_row("plan − trace", f"{traced['error_pct']:+.2f} %")
    return t
