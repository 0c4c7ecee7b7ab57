"""Fault injection (debug.*) wraps the loop's pieces once at setup: in a real run every wrapper hands back
what it was given, so the loop holds no fault call; with a debug field set the fault strikes where the
loop would have called it (before step N starts; before the final checkpoint for training.steps + 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dtlaunch.config.schema import DebugConfig
from dtlaunch.train.features.fault_injection import Faults


def _faults(rank: int = 0, **debug: int) -> Faults:
    """This rank's faults for the schema's debug section (its defaults: a real run) with `debug` set."""
    return Faults.of(SimpleNamespace(debug=DebugConfig(**debug)), rank)


def test_a_real_run_gets_its_own_pieces_back() -> None:
    faults = _faults()
    steps = range(1, 5)

    def step_fn(*args: object) -> None:
        return None

    def save(step: int) -> None:
        return None

    assert faults.wrap_steps(steps) is steps
    assert faults.wrap_step(step_fn) is step_fn
    assert faults.wrap_final_save(save, 4) is save
    rollout = SimpleNamespace()
    assert faults.wrap_rollout(rollout) is rollout and vars(rollout) == {}


def test_a_failure_strikes_before_its_step_and_only_on_its_rank() -> None:
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        for step in _faults(rank=1, fail_at_step=3, fail_rank=1).wrap_steps(range(1, 5)):
            ran.append(step)
    assert ran == [1, 2]
    assert list(_faults(rank=0, fail_at_step=3, fail_rank=1).wrap_steps(range(1, 5))) == [1, 2, 3, 4]


def test_a_failure_after_the_last_step_strikes_before_the_final_save() -> None:
    saved: list[int] = []
    faults = _faults(fail_at_step=5)
    assert list(faults.wrap_steps(range(1, 5))) == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        faults.wrap_final_save(saved.append, 4)(4)
    assert saved == []
