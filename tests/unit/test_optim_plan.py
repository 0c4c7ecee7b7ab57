"""The optimizer options' planner terms against what torchao really allocates, and the torchao refusal."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.layout import Layout
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.plan.stage import plan_stage

TINY = ["model=tiny", "hardware=cpu", "training.seq_len=16", "training.micro_batch=2"]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every moment's storages (a quantised moment's codes, scales and code table)."""

    def leaves(t: torch.Tensor):
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            for n in names:
                yield from leaves(getattr(t, n))
        else:
            yield t

    return sum(
        leaf.untyped_storage().nbytes()
        for state in opt.state.values()
        for key, value in state.items()
        if key != "step"
        for leaf in leaves(value)
    )


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adamw"])
def test_planned_state_equals_torchao_state(name: str) -> None:
    pytest.importorskip("torchao")
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.observe.memtrack import StorageCounter
    from dtlaunch.train.optim import build_optimizer
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    cfg = compose([*TINY, f"optim.name={name}"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with StorageCounter():  # torchao's update then runs eagerly: no compile in a unit test
        opt.step()
    layout = Layout.resolve(cfg.strategy, 1)
    planned = plan_stage(cfg, layout, 0, int(cfg.model.n_layers), True, True)
    lines = {**planned.lines}
    assert lines["optimizer state"] == _state_bytes(opt)


def test_lowbit_without_torchao_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlaunch.job.rules.optim import check_optim

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    cfg = compose([*TINY, "optim.name=adamw8bit"]).cfg
    with pytest.raises(ConfigError, match=r"pip install 'dtlaunch\[lowbit-optim\]'"):
        check_optim(cfg, Decisions.of(cfg, Layout.resolve(cfg.strategy, 1)), [])


def test_in_backward_plans_no_gradients_at_the_step() -> None:
    after = compose([*TINY, "training.grad_clip=0"]).cfg
    inside = compose([*TINY, "training.grad_clip=0", "optim.in_backward=true"]).cfg
    layout = Layout.resolve(after.strategy, 1)
    a = plan_stage(after, layout, 0, 4, True, True)
    b = plan_stage(inside, layout, 0, 4, True, True)
    assert b.phases["optimizer"] < a.phases["optimizer"]
    assert b.peak <= a.peak
