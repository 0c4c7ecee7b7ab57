"""Every objective is one `Objective` (dtlaunch.train.objectives): the loop and the step call the same four
things of each, so neither asks which objective it runs. Next-token training is one of them (sft.py): its
micro-step loss is the plain token mean / accum, or, on masked chat data, the summed token loss times the
loader's weight, the share of the global batch's mean."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.job.compose import compose
from dtlaunch.train.batch import MicroBatch
from dtlaunch.train.data import IGNORE_INDEX
from dtlaunch.train.loss import HeadLoss
from dtlaunch.train.objectives import build_objective
from dtlaunch.train.objectives.sft import NextTokenObjective


@pytest.mark.parametrize("name", [n.value for n in ObjectiveName])
def test_every_objective_name_builds_an_objective_the_step_can_call(name: str) -> None:
    cfg = compose(["model=tiny", f"objective={name}", "data.kind=synthetic"]).cfg
    objective = build_objective(cfg, Decisions.of(cfg, Layout.resolve(cfg.strategy, 1)), None)
    for attr in ("step_data", "step_loss", "summarize"):
        assert callable(getattr(objective, attr)), (name, attr)
    assert isinstance(objective.stats_len, int) and isinstance(objective.needs_reference, bool)
    assert (objective.stats_len == 0) == (name == "sft")  # every other objective logs its statistics
    if name in ("sft", "dpo", "orpo", "simpo"):  # the objectives that run under pipeline parallel
        assert callable(objective.pipeline_rows)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    return logits, targets


def test_next_token_loss_is_the_token_mean_over_accumulation() -> None:
    logits, targets = _rows()
    loss, stats = NextTokenObjective().step_loss(
        logits, targets, MicroBatch(targets, targets), None, HeadLoss(None, 1), 4
    )
    assert stats is None
    assert loss.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item() / 4, rel=1e-6)


def test_masked_rows_are_weighted_to_their_share_of_the_global_mean() -> None:
    """Two micro-steps with 7 and 2 counted targets: their losses add up to the mean over all 9 targets, not
    to the mean of the two micro-batch means (the loader's weight: micro-steps x 1 / global targets)."""
    (a, ta), (b, tb) = _rows(), _rows()
    ta[:, :3] = IGNORE_INDEX
    ta[0, :4] = IGNORE_INDEX  # 7 targets count
    tb[:] = IGNORE_INDEX
    tb[1, 2:4] = 5  # 2 targets count
    counted = int((ta != IGNORE_INDEX).sum() + (tb != IGNORE_INDEX).sum())
    weight = 2 / counted  # TokenLoader: global_batch / (micro_batch * counted), one rank, 2 micro-steps
    objective, head = NextTokenObjective(), HeadLoss(None, 1)
    total = sum(
        objective.step_loss(x, t, MicroBatch(t, t, loss_weight=weight), None, head, 2)[0] for x, t in ((a, ta), (b, tb))
    )
    every = F.cross_entropy(torch.cat([a, b]).flatten(0, 1), torch.cat([ta, tb]).flatten(), ignore_index=IGNORE_INDEX)
    assert total.item() == pytest.approx(every.item(), rel=1e-6)
    naive = (F.cross_entropy(a.flatten(0, 1), ta.flatten()) + F.cross_entropy(b.flatten(0, 1), tb.flatten())) / 2
    assert abs(naive.item() - every.item()) > 1e-3  # the weighting matters on these rows


def test_the_step_and_the_loop_never_ask_which_objective_runs() -> None:
    """The loop's and the step's code reach the objective only through the protocol."""
    import inspect

    from dtlaunch.train import step, trainer

    for module in (step, trainer):
        source = inspect.getsource(module)
        for needle in ("objective is None", "objective is not None", "objective.name", "ObjectiveName"):
            assert needle not in source, (module.__name__, needle)


def test_a_runtime_built_without_an_objective_trains_next_token() -> None:
    """The benches and tests that assemble a Runtime by hand name no objective: they train next-token."""
    from dataclasses import fields

    from dtlaunch.train.runtime import Runtime

    (objective,) = [f for f in fields(Runtime) if f.name == "objective"]
    assert isinstance(objective.default_factory(), NextTokenObjective)


def test_rows_already_on_a_device_are_not_pinned():
    """A GRPO rollout's rows are generated on the GPU; the step moves host rows there through pinned
    memory, which only a CPU tensor has (an H200 run failed at its first step: "cannot pin
    'torch.cuda.LongTensor'"). A meta tensor stands in for a device tensor on this CUDA-less build: the move
    must reach `.to()` (which then fails for want of CUDA), not `pin_memory()`."""
    from dtlaunch.train.step import to_device

    on_device = torch.zeros(2, dtype=torch.long, device="meta")
    with pytest.raises((AssertionError, RuntimeError)) as err:
        to_device(on_device, torch.device("cuda"))
    assert "pin" not in str(err.value), err.value
    host = torch.arange(3)
    assert to_device(host, torch.device("cpu")) is host
