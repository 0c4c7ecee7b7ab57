"""`dtlaunch plan --trace` on every shipped recipe: the traced second opinion, or a one-line reason why this
machine cannot trace the job, next to the analytic plan; never an internal error. The recipes' layouts,
objectives and savers as shipped, at reduced depth and sequence length (compile off: compiling under fake
tensors takes minutes, and the trace's compiled path is that of the blocks it replays)."""

import json
from pathlib import Path

import pytest

import dtlaunch
from dtlaunch.commands.common import load_job
from dtlaunch.commands.plan import plan_command

RECIPES = sorted(p.stem for p in (Path(dtlaunch.__file__).parent.parent / "recipes").glob("*.yaml"))


def _shrunk(name: str) -> list[str]:
    job = load_job([f"recipe={name}"])
    t = job.cfg.training
    layers = min(int(job.cfg.model.n_layers), 2 * job.layout.pp)
    return [f"recipe={name}", f"model.n_layers={layers}", f"training.seq_len={min(int(t.seq_len), 512)}"] + (
        ["training.compile=false"] if t.compile else []
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_plan_trace_runs_on_every_recipe(name, capsys):
    code = plan_command(_shrunk(name), [], as_json=True, trace=True)
    assert code in (0, 3)
    traced = json.loads(capsys.readouterr().out)["trace"]
    if "skipped" in traced:
        assert "\n" not in traced["skipped"]
        return
    # At these reduced shapes the figures are not the recipe's; their agreement at real shapes is
    # tests/unit/test_plan_trace.py's subject.
    assert traced["peak_bytes"] > 0 and traced["analytic_peak_bytes"] > 0
