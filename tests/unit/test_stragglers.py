"""Slow-rank arithmetic (dtlaunch.train.stragglers): own time per step from the gaps and periods each rank
measured, and the rule that names a rank only when it is persistently slower by more than the threshold."""

from __future__ import annotations

from dtlaunch.train.observe.stragglers import StragglerWatch, own_ms


def test_own_time_is_the_period_less_the_wait_for_the_latest_rank() -> None:
    # Rank 1 starts 50 ms late every step; the period (100 ms) is the same for both: rank 0 waited 50 ms.
    assert own_ms([10.0, 60.0, 100.0, 100.0], world=2) == [50.0, 100.0]
    assert own_ms([10.0, 60.0, 100.0, 0.0], world=2) is None  # a rank measured no step in the window


def test_a_rank_is_named_only_when_persistently_slower_than_the_threshold() -> None:
    watch = StragglerWatch(world=4, threshold=0.10)
    for _ in range(2):
        watch.add([30.0, 30.0, 40.0, 31.0])
    assert watch.slowest() is None  # too few windows to call it persistent
    watch.add([30.0, 30.0, 40.0, 31.0])
    watch.add([45.0, 30.0, 39.0, 30.0])  # one slow window of rank 0 does not make it the slow rank
    slow = watch.slowest()
    assert slow == {"rank": 2, "median_ms": 40.0, "others_median_ms": 30.0, "slower_by": round(40 / 30 - 1, 4)}
    assert "slow rank 2: 40.0 ms/step vs 30.0 ms (+33%)" in watch.live()
    within = StragglerWatch(world=2, threshold=0.10)
    for _ in range(5):
        within.add([30.0, 32.9])  # +9.7 %: under the threshold
    assert within.slowest() is None and within.live() == ""
    assert StragglerWatch(world=2, threshold=0.0).slowest() is None  # 0 = off
