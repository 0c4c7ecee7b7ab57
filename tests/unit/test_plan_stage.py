"""The planner's phases (dtlaunch.plan.stage), each against the categories torch's memory tracker
measures for the same step (the planner's trace runs the worker's runtime and train_step on real CPU
tensors, one rank emulated on a fake process group)."""

import pytest

from dtlaunch.config.layout import Layout
from dtlaunch.job.compose import compose
from dtlaunch.plan.stage import backward_peak, forward_lines, optimizer_lines, plan_stage, stage_shape, static_lines

# The full-vocabulary loss: the step's peak is at the loss's backward, where the tracked categories are
# the forward lines. A chunked loss (the default) moves this small-vocabulary model's peak into a block's
# backward, after some activations are freed: that case checks the peak only.
FULL = "training.loss_chunks=1"
CASES = {
    "ddp-1": (["recipe=tiny_ddp", "launch.nproc_per_node=1", "precision=fp32", FULL], 1),
    "ddp-1-accumulate": (
        ["recipe=tiny_ddp", "launch.nproc_per_node=1", "precision=fp32", "training.global_batch=16", FULL],
        1,
    ),
    "fsdp-2": (["recipe=tiny_fsdp", "precision=fp32", FULL], 2),
    "ddp-1-chunked-loss": (["recipe=tiny_ddp", "launch.nproc_per_node=1", "precision=fp32"], 1),
}


def close(planned: float, measured: float, rel: float) -> bool:
    return abs(planned - measured) <= rel * max(measured, 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_phase_matches_the_tracked_categories(case):
    from dtlaunch.plan.trace import trace_peak

    overrides, world = CASES[case]
    cfg = compose(overrides).cfg
    layout = Layout.resolve(cfg.strategy, world)
    traced = trace_peak(cfg, layout, rank=0, fake=False)
    cats = traced["categories"]
    c = stage_shape(cfg, layout, 0, int(cfg.model.n_layers), first=True, last=True)
    static = static_lines(c)
    params = cats.get("Parameter", cats.get("Sharded Param"))
    assert close(static["parameters"], params, 1e-3), (static, cats)
    assert close(static["buffers"], cats["Buffer"], 1e-3), (static, cats)
    # The tracker's optimizer state also holds Adam's step counters (a few bytes per tensor).
    assert close(static["optimizer state"], cats.get("Optstate", cats.get("OptState")), 1e-3), (static, cats)
    if "accumulated gradients" in static:  # gradients held between micro-steps
        assert close(static["accumulated gradients"], cats["Gradient"], 1e-3), (static, cats)
    forward = forward_lines(c)
    if int(cfg.training.loss_chunks) == 1:
        assert close(forward["activations"], cats["Activation"], 1e-3), (forward, cats)
    lines = {**static, **forward}
    at_step = optimizer_lines(c, lines)
    assert "activations" not in at_step and at_step["gradients"] == c.gradient_bytes
    # The step's peak (this model's is in backward): the backward phase against the traced peak.
    peak = backward_peak(c, lines)
    assert peak >= sum(at_step.values()) and peak >= sum(lines.values())
    assert close(peak, traced["peak_bytes"], 0.03), (peak, traced["peak_bytes"])
    assert plan_stage(cfg, layout, 0, int(cfg.model.n_layers), True, True).peak == peak
