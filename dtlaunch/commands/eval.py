"""`dtlaunch eval SOURCE --tasks T1,T2`: lm-evaluation-harness on dtlaunch's own model; a table on the
terminal and the results in RUN/eval/<time>.json (or --out)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.commands.common import console
from dtlaunch.infer.harness import (
    TRAINING_KEYS,
    EvalRequest,
    check_request,
    eval_request,
    evaluate_source,
    metric_rows,
    require_lm_eval,
    resolve_source,
)

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def eval_command(
    source: str,
    tasks: str,
    limit: int,
    num_fewshot: int,
    batch_size: int,
    include: str,
    adapter: str,
    apply_chat_template: bool,
    out: str,
) -> int:
    req = EvalRequest(
        tasks=[t.strip() for t in tasks.split(",")],
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        include=include,
        apply_chat_template=apply_chat_template,
    )
    # Cheap checks first: a wrong path is reported before the task index (seconds) or the model loads.
    src = resolve_source(source, out, adapter)
    manager = check_request(req)
    record, path = evaluate_source(src, req, manager, adapter)
    show_results(record)
    console().print(f"results: {path}", markup=False, soft_wrap=True)
    return 0


def show_results(record: dict) -> None:
    console().print(results_table(record))


def results_table(record: dict) -> Any:
    from rich.table import Table

    step = f" at step {record['step']}" if record.get("step") is not None else ""
    t = Table(title=f"eval: {record['source']}{step}", title_justify="left")
    for name, justify in (("task", "left"), ("metric", "left"), ("value", "right"), ("± stderr", "right")):
        t.add_column(name, justify=justify)
    for task, metric, value, err in metric_rows(record["results"]):
        t.add_row(task, metric, f"{value:.4f}", "" if err is None else f"{err:.4f}")
    return t


def check_eval_runs_here(cfg: JobConfig) -> None:
    """`train`, before any worker starts: the evaluation after training runs in this environment, so lm-eval's
    model class must import here and, offline, the tasks' hub datasets must be cached here (a submitted job
    evaluates on the cluster, which checks there). The names, the include directory and the chat template
    were checked with the job's other inputs (dtlaunch.launch.job_inputs.check_eval_inputs)."""
    if not cfg.training.eval_tasks:
        return
    require_lm_eval()
    check_request(eval_request(cfg), *TRAINING_KEYS, datasets_here=True, build_manager=False)


def eval_after_training(cfg: JobConfig, run_dir: Any) -> None:
    """training.eval_tasks on the run's final checkpoint, in the launcher once the workers have exited:
    the checkpoint holds the full model whatever layout trained it, so one process on one device loads
    it as `dtlaunch eval RUN` does (no gathering of shards, no process group for lm_eval to meet, and
    the workers' GPU memory is free again)."""
    if not cfg.training.eval_tasks:
        return
    req = eval_request(cfg)
    manager = check_request(req, *TRAINING_KEYS)
    record, path = evaluate_source(resolve_source(str(run_dir)), req, manager)
    show_results(record)
    console().print(f"eval results: {path}", markup=False, soft_wrap=True)
