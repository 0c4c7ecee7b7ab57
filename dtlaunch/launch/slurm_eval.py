"""training.eval_tasks on Slurm: the evaluation of the final checkpoint as a job of its own.

`dtlaunch submit` sends it right after the training job with `sbatch --dependency=afterok:<training job>`,
so it starts only once training has ended with exit 0, and runs under its own time limit
(cluster.eval_time): training keeps all of cluster.time, and a training job that uses its whole limit
cannot leave the evaluation to be killed by it.

Requeue: a requeued training job (its own `scontrol requeue` after the time-limit signal, preemption with
PreemptMode=REQUEUE, or an external `scontrol requeue`) goes back to PENDING under the same job id
without ever reaching a final state, so the dependency stays unresolved (Reason=Dependency) until an
attempt really ends. COMPLETED (exit 0) releases the evaluation; any other end (FAILED, CANCELLED,
TIMEOUT, a requeue that could not be done: exit 75) can never satisfy it, and `--kill-on-invalid-dep=yes`
cancels the evaluation job then instead of leaving it pending forever.

One node, one task: the checkpoint holds the full model, and `dtlaunch eval` loads it on one device
(one GPU when the hardware profile has GPUs, else the CPUs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dtlaunch.launch.slurm import EVAL_MODULE, _gpus_per_node, _q, site_options, user_sbatch_args
from dtlaunch.run.env import RUN_DIR_ENV

EVAL_SCRIPT_NAME = "slurm-eval.sbatch"


def wants_eval_job(cfg: Any) -> bool:
    return bool(cfg.training.eval_tasks)


def dependency_option(train_job_id: str) -> str:
    """The `sbatch` option that holds the evaluation until this training job (or array task) succeeded."""
    return f"--dependency=afterok:{train_job_id}"


def eval_sbatch_options(cfg: Any, run_dir: Path, job_name: str) -> list[str]:
    """The evaluation job's `#SBATCH` options, already quoted: the training job's site options
    (partition, account, qos, mem, sbatch_args) on one node with one task and one GPU, its own time
    limit (cluster.eval_time). Requeued when preempted or its node is lost: it evaluates again from the
    start (it writes its results only at the end)."""
    opts = [f"--job-name={_q('run.name', job_name + '-eval')}", "--nodes=1", "--ntasks=1"]
    if _gpus_per_node(cfg):
        opts.append("--gpus-per-node=1")
    opts += site_options(cfg, run_dir, "eval_time")
    # Training ended in any other way than exit 0: cancel this job rather than leave it pending forever.
    opts.append("--kill-on-invalid-dep=yes")
    return opts + user_sbatch_args(cfg)


def render_eval_script(cfg: Any, run_dir: Path, job_name: str = "", python: str = "") -> str:
    """The evaluation job's sbatch script (bash); submitted with dependency_option(<training job id>)."""
    run_dir = Path(run_dir)
    job_name = job_name or run_dir.name
    python = python or sys.executable
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in eval_sbatch_options(cfg, run_dir, job_name)]
    lines += [
        f"# Written by `dtlaunch submit` for the run in {_q('run.dir', run_dir)}: training.eval_tasks on its final",
        "# checkpoint. Submitted with `sbatch --dependency=afterok:<training job id>`: it starts only after the",
        "# training job has ended with exit 0.",
        "set -u",
        f"export {RUN_DIR_ENV}={_q('run.dir', run_dir)}",
    ]
    if cfg.cluster.setup:
        lines.append("# cluster.setup (shell code, run as written)")
        lines += [str(s) for s in cfg.cluster.setup]
    lines += [
        "# One process: it gets all of the job's CPUs.",
        f'OMP_NUM_THREADS="${{SLURM_CPUS_ON_NODE:-1}}" exec {_q("python", python)} -m {EVAL_MODULE} '
        f"{_q('run.dir', run_dir)}",
    ]
    return "\n".join(lines) + "\n"
