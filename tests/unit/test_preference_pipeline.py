"""Preference pairs through a pipeline schedule (dtlaunch.train.objectives.pipeline): torch cuts the rows
into pipeline micro-batches along dim 0, so each cut must hold whole pairs, chosen rows then rejected
rows; the reference's log-probs ride in the targets bit for bit."""

from __future__ import annotations

import torch

from dtlaunch.train.objectives.pipeline import pair_rows, split_reference, with_reference


def test_every_pipeline_micro_batch_holds_its_pairs_chosen_then_rejected() -> None:
    pairs, n = 6, 3
    rows = torch.arange(2 * pairs)  # rows 0..5 chosen, 6..11 rejected of pairs 0..5
    for j, cut in enumerate(rows[pair_rows(pairs, n)].tensor_split(n)):
        chosen, rejected = cut.chunk(2)
        assert chosen.tolist() == [2 * j, 2 * j + 1]
        assert (rejected - pairs).tolist() == chosen.tolist()


def test_the_reference_rides_in_the_targets_exactly() -> None:
    targets = torch.randint(-100, 50, (4, 7))
    ref = torch.tensor([-12.345678, -0.1, -1e-8, -3e4], dtype=torch.float32)
    packed = with_reference(targets, ref)
    for cut_t, cut_r, cut in zip(targets.tensor_split(2), ref.tensor_split(2), packed.tensor_split(2), strict=True):
        got_t, got_r = split_reference(cut, has_reference=True)
        assert torch.equal(got_t, cut_t) and torch.equal(got_r, cut_r)
    assert with_reference(targets, None) is targets and split_reference(targets, False) == (targets, None)
