"""The loop's per-window agreement (WindowSync), the on-device skip of a non-finite step, and the
validation of the new training/precision options. In-process, one rank."""

from __future__ import annotations

import copy

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.train.optim import step_unless_nonfinite
from dtlaunch.train.step_sync import WindowSync


def _push(sync: WindowSync, step: int, loss: float, signal: int = 0, applied: object = True) -> list:
    return sync.push(step, torch.tensor(loss), torch.tensor(0.5 * step), applied, signal, lr=0.1 * step)


def test_outcomes_arrive_one_window_later_in_order() -> None:
    sync = WindowSync(torch.device("cpu"), log_every=2, total_steps=5)
    assert _push(sync, 1, 1.0) == [] and _push(sync, 2, 2.0) == []  # window 1..2 sent, nothing read yet
    assert _push(sync, 3, 3.0) == []
    done = _push(sync, 4, float("nan"), applied=torch.tensor(False))  # window 3..4 sent, 1..2 read
    assert [(o.step, o.loss, o.grad_norm, o.applied, o.host["lr"]) for o in done] == [
        (1, 1.0, 0.5, True, 0.1),
        (2, 2.0, 1.0, True, 0.2),
    ]
    done = _push(sync, 5, 5.0)  # the last step closes a window
    assert [o.step for o in done] == [3, 4] and done[1].applied is False
    assert [o.step for o in sync.drain()] == [5]
    assert sync.drain() == []


def test_a_stop_signal_is_agreed_when_its_window_is_read() -> None:
    sync = WindowSync(torch.device("cpu"), log_every=1, total_steps=10)
    _push(sync, 1, 1.0, signal=15)
    assert sync.signum == 0  # sent, not read yet
    _push(sync, 2, 1.0)
    assert sync.signum == 15


def test_fast_steps_widen_the_window_in_whole_log_every_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 1/128 s and an interval of 10 of them (exact in binary): after the first window is read,
    windows span 10 steps (5 periods of log_every=2); every outcome still arrives, in order, and the
    last step closes a window."""
    clock = [0.0]
    monkeypatch.setattr("dtlaunch.train.step_sync.time.perf_counter", lambda: clock[0])
    sync = WindowSync(torch.device("cpu"), log_every=2, total_steps=40, interval_s=10 / 128)
    sent_at, seen = [], []
    for step in range(1, 41):
        clock[0] += 1 / 128
        before = sync._in_flight
        seen += [o.step for o in _push(sync, step, float(step))]
        if sync._in_flight is not before:
            sent_at.append(step)
    seen += [o.step for o in sync.drain()]
    assert seen == list(range(1, 41))
    # The first proposal is read with the second window; the last step closes a short one.
    assert sent_at == [2, 4, 14, 24, 34, 40] and sync.window == 10


def test_interval_zero_keeps_one_window_per_log_every() -> None:
    sync = WindowSync(torch.device("cpu"), log_every=3, total_steps=12, interval_s=0.0)
    for step in range(1, 13):
        _push(sync, step, 1.0)
    assert sync.window == 3


def test_fused_adamw_skips_a_nonfinite_step_on_the_device() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.randn(3, 8)).sum().backward()
    step_unless_nonfinite(opt, torch.tensor(1.0))
    before, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    model(torch.randn(3, 8)).sum().backward()
    step_unless_nonfinite(opt, torch.tensor(float("inf")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])
    step_unless_nonfinite(opt, torch.tensor(1.0))  # a finite step applies
    assert not torch.equal(before["weight"], model.state_dict()["weight"])
    assert not hasattr(opt, "found_inf")


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["precision.float8=rowwise", "precision=bf16"], "needs float8 tensor cores, which hardware=cpu"),
        (["precision.float8=rowwise", "precision=bf16", "hardware=a100_80gb"], "hardware=a100_80gb does not"),
        (["precision.float8=e4m3"], "precision.float8='e4m3' is unknown"),
        (["training.activation_checkpointing=selective", "training.ac_memory_budget=0.5"], "set training.compile=true"),
        (["training.ac_policy=block"], "training.ac_policy='block' is unknown"),
        (["training.ac_every_n_layers=0"], "training.ac_every_n_layers=0 is out of range"),
    ],
)
def test_bad_speed_options_are_one_line_errors(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_job(["recipe=tiny_ddp", *overrides])


def test_float8_is_planned_on_hopper() -> None:
    from dtlaunch.plan.memory import plan_memory

    job = load_job(["recipe=llama8b_fsdp", "precision.float8=tensorwise"])
    assert "float8 casts" in plan_memory(job.cfg, job.layout).worst.lines
