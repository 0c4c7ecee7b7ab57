"""The step-time breakdown's interval arithmetic and categories (dtlaunch.report.breakdown).

The interval operations are checked against counting points on a fine grid (an independent way to the
same lengths); the categories on a small hand-made trace whose answer is worked out in the comments.
"""

from __future__ import annotations

import random

import pytest

from dtlaunch.report.breakdown import CATEGORIES, breakdown, intersect, length, subtract, union


def _grid_length(pred, lo: int = 0, hi: int = 200) -> float:
    """Length of the set {x : pred(x)} on [lo, hi), counted at midpoints of a 0.5 grid."""
    return 0.5 * sum(1 for i in range(2 * lo, 2 * hi) if pred(i / 2 + 0.25))


def _inside(intervals, x: float) -> bool:
    return any(a <= x < b for a, b in intervals)


@pytest.mark.parametrize("seed", range(20))
def test_interval_operations_match_point_counting(seed: int) -> None:
    rng = random.Random(seed)

    def some() -> list[tuple[float, float]]:
        out = []
        for _ in range(rng.randint(0, 8)):
            a = rng.randint(0, 190)
            out.append((a, a + rng.randint(0, 30)))
        return out

    xs, ys = some(), some()
    ux, uy = union(xs), union(ys)
    assert all(a < b for a, b in ux) and all(ux[i][1] < ux[i + 1][0] for i in range(len(ux) - 1))
    assert length(ux) == _grid_length(lambda x: _inside(xs, x), hi=230)
    assert length(intersect(ux, uy)) == _grid_length(lambda x: _inside(xs, x) and _inside(ys, x), hi=230)
    assert length(subtract(ux, uy)) == _grid_length(lambda x: _inside(xs, x) and not _inside(ys, x), hi=230)


def _op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def test_categories_of_a_hand_made_step() -> None:
    # Step 0..100 us on thread 1. Data 0..10 (an op inside it counts as data). Compute: ops 10..40 and
    # 50..70 (a c10d enqueue 40..42 is not compute). A collective on gloo's thread 2 from 30..60: overlapped
    # with compute 30..40 and 50..60 (20), exposed 40..50 (10). A p2p recv on thread 1 from 70..85: bubble
    # 15. Host: the rest, 100 - 10 - 50 - 10 - 15 = 15.
    events = [
        _op("dtlaunch.step", 0, 100, cat="user_annotation"),
        _op("dtlaunch.data", 0, 10, cat="user_annotation"),
        _op("aten::copy_", 2, 5),
        _op("aten::mm", 10, 30),
        _op("c10d::allreduce_", 40, 2),
        _op("aten::add", 50, 20),
        _op("gloo:all_reduce", 30, 30, tid=2),
        _op("gloo:recv", 70, 15),
        _op("aten::mm", 150, 10),  # after the step: not counted
    ]
    got = breakdown(events)
    want = {"compute": 50, "comm_exposed": 10, "bubble": 15, "data": 10, "host": 15, "comm_overlapped": 20}
    assert {k: round(v * 1e6, 6) for k, v in got.items() if k != "step_s"} == want
    assert got["step_s"] == pytest.approx(100e-6)
    assert sum(got[c] for c in CATEGORIES) == pytest.approx(got["step_s"])


def test_categories_of_a_hand_made_gpu_step() -> None:
    # GPU: compute is kernel time. Kernels 10..50; an NCCL kernel 40..60 (overlapped 10, exposed 10); the
    # host loads data 0..20, of which 10..20 is hidden behind kernels (data 10). Host: 100 - 40 - 10 - 10.
    events = [
        _op("dtlaunch.step", 0, 100, cat="user_annotation"),
        _op("dtlaunch.data", 0, 20, cat="user_annotation"),
        _op("aten::mm", 0, 15),  # host-side operators do not count as compute when kernels exist
        _op("sm90_gemm_kernel", 10, 40, tid=7, cat="kernel"),
        _op("ncclDevKernel_AllGather_RING_LL", 40, 20, tid=8, cat="kernel"),
    ]
    got = breakdown(events)
    want = {"compute": 40, "comm_exposed": 10, "bubble": 0, "data": 10, "host": 40, "comm_overlapped": 10}
    assert {k: round(v * 1e6, 6) for k, v in got.items() if k != "step_s"} == want


def test_a_trace_without_the_step_annotation_is_refused() -> None:
    with pytest.raises(ValueError, match="dtlaunch.step"):
        breakdown([_op("aten::mm", 0, 10)])
