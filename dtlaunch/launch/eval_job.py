"""`python -m dtlaunch.launch.eval_job RUN_DIR`: training.eval_tasks on a finished run, for a cluster job's
launcher. The Slurm batch shell runs it once, after the srun step (every worker on every node) has exited
with 0: the same evaluation `dtlaunch train` runs in its launcher (dtlaunch.commands.eval.eval_after_training),
results in RUN_DIR/eval/<time>.json. Errors are the CLI's one line and exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    from dtlaunch.commands.eval import eval_after_training
    from dtlaunch.config.compose import load_resolved
    from dtlaunch.launch.rundir import CONFIG_NAME

    if len(argv) != 1:
        print("usage: python -m dtlaunch.launch.eval_job RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    eval_after_training(load_resolved(run_dir / CONFIG_NAME), run_dir)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException as exc:  # the CLI's one line on stderr and its documented exit code
        from dtlaunch.cli import exit_code_of

        code = exit_code_of(exc)
    sys.exit(code)
