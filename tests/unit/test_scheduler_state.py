"""The LR scheduler's state across layouts whose optimizers have different numbers of parameter groups
(a tensor-parallel plan that leaves some parameters plain splits each group by kind: train/optim.py)."""

from __future__ import annotations

import pytest
import torch

from dtlaunch.errors import ConfigError
from dtlaunch.train.checkpoint.states import SchedulerState


def _scheduler(groups: int, lr: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    params = [[torch.nn.Parameter(torch.ones(2))] for _ in range(groups)]
    opt = torch.optim.AdamW([{"params": p} for p in params], lr=lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))


@pytest.mark.parametrize(("saved_groups", "groups"), [(2, 4), (4, 2), (2, 2)])
def test_a_saved_schedule_resumes_with_any_number_of_groups(saved_groups: int, groups: int) -> None:
    saved = _scheduler(saved_groups)
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    state = SchedulerState([saved]).state_dict()
    resumed = _scheduler(groups)
    SchedulerState([resumed]).load_state_dict(state)
    resumed.optimizer.step()
    resumed.step()  # fails with a saved list of another length (zip in get_lr)
    saved.optimizer.step()
    saved.step()
    assert resumed.get_last_lr() == [saved.get_last_lr()[0]] * groups


def test_groups_at_different_rates_are_refused_in_one_line() -> None:
    state = SchedulerState([_scheduler(2)]).state_dict()
    state["schedulers"][0]["base_lrs"] = [0.1, 0.2]
    with pytest.raises(ConfigError) as err:
        SchedulerState([_scheduler(4)]).load_state_dict(state)
    assert "\n" not in str(err.value) and "resume with the layout that wrote it" in str(err.value)
