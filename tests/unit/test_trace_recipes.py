"""`dtlaunch plan --trace` on every shipped recipe: the traced second opinion, or a one-line reason why this
machine cannot trace the job; never an internal error. The recipes' layouts, objectives and savers as
shipped, at reduced depth and sequence length, traced on the kind of tensors (fake or real) the full
recipe's trace uses (compile off: compiling under fake tensors takes minutes; the blocks it would compile
are the ones traced)."""

from pathlib import Path

import pytest

import dtlaunch
from dtlaunch.commands.common import load_job
from dtlaunch.plan.trace import real_tensors_needed, skip_reason, trace_peak, traced_with_fake_tensors

RECIPES = sorted(p.stem for p in (Path(dtlaunch.__file__).parent.parent / "recipes").glob("*.yaml"))


def _shrunk(name: str, full) -> list[str]:
    t = full.cfg.training
    layers = min(int(full.cfg.model.n_layers), 2 * full.layout.pp)
    seq = min(int(t.seq_len), 512)
    extra = ["training.compile=false"] if t.compile else []
    if str(full.cfg.objective.name) == "grpo":  # the completion must leave room for a prompt in the shorter rows
        extra.append(f"objective.max_completion_length={min(int(full.cfg.objective.max_completion_length), seq // 2)}")
    return [f"recipe={name}", f"model.n_layers={layers}", f"training.seq_len={seq}", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_plan_trace_runs_on_every_recipe(name):
    full = load_job([f"recipe={name}"])
    fake = traced_with_fake_tensors(full.cfg, full.layout)
    job = load_job(_shrunk(name, full))
    reason = skip_reason(job.cfg, job.layout, fake) or skip_reason(full.cfg, full.layout)
    if reason:  # what `plan --trace` prints instead, beside the analytic plan
        assert "\n" not in reason
        return
    traced = trace_peak(job.cfg, job.layout, fake=fake)
    fake = fake and not real_tensors_needed(job.cfg, job.layout)
    assert traced["peak_bytes"] > 0 and traced["tensors"] == ("fake" if fake else "real")
