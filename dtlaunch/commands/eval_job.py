"""`python -m dtlaunch.commands.eval_job RUN_DIR`: training.eval_tasks on a finished run, for a cluster job.
On Slurm it is the evaluation job (dtlaunch.launch.slurm_script), which Slurm starts only after the training
job has ended with 0: the same evaluation `dtlaunch train` runs in its launcher
(dtlaunch.commands.eval.eval_after_training), results in RUN/eval/<time>.json. A run whose newest
checkpoint is not its final step (training not finished: the script submitted by hand, or a dependency
removed) is refused rather than evaluated at some earlier step. Errors are the CLI's one line and exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dtlaunch.errors import exit_code_of

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_finished(cfg: JobConfig, run_dir: Path) -> None:
    """The run's newest complete checkpoint is its final one (step >= training.steps)."""
    from dtlaunch.errors import InputError
    from dtlaunch.infer.harness import resolve_source

    steps = int(cfg.training.steps)
    step = resolve_source(str(run_dir)).step
    if step is None or step < steps:
        raise InputError(
            f"training.eval_tasks: the newest checkpoint of {run_dir} is step {step} of training.steps={steps}: "
            f"training has not finished; evaluate after it has (or `dtlaunch eval {run_dir} --tasks ...` for now)"
        )


def main(argv: Sequence[str]) -> int:
    from dtlaunch.commands.eval import eval_after_training
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.run.run_dir import CONFIG_NAME

    if len(argv) != 1:
        print("usage: python -m dtlaunch.commands.eval_job RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    cfg = load_resolved(run_dir / CONFIG_NAME)
    if cfg.training.eval_tasks:
        check_finished(cfg, run_dir)
    eval_after_training(cfg, run_dir)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException as exc:  # the CLI's one line on stderr and its documented exit code
        code = exit_code_of(exc)
    sys.exit(code)
