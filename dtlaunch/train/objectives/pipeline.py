"""Preference objectives under pipeline parallel: the last stage's loss_fn scores each pipeline micro-batch.

torch's schedule cuts a micro-step's rows into `n` pipeline micro-batches along dim 0, but a preference
micro-batch stacks all chosen rows above all rejected rows (train/loss.py). `pair_rows` regroups the rows so
that every pipeline micro-batch holds its own pairs, chosen rows then rejected rows, in the same order.

The loss_fn sees only (output, target) per pipeline micro-batch, so DPO's reference log-probs ride in the
target: one extra column holding each row's float64 bits (`with_reference`). They are known before the
schedule runs: precomputed (objective.precompute_reference), or computed just before it by a no-grad
forward through the stages (pipeline_reference.py).

Each pipeline micro-batch's loss is its mean over its pairs times 1 / (n * accum), so the step's
gradient is that of the mean over the global batch, as without a pipeline (dtlaunch.train.loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from dtlaunch.train.batch import MicroBatch


def pair_rows(pairs: int, n_microbatches: int) -> torch.Tensor:
    """Row order of a (2 * pairs)-row micro-batch that puts each of the `n_microbatches` runs of
    pairs / n pairs together: [its chosen rows, its rejected rows] per pipeline micro-batch."""
    k = pairs // n_microbatches
    runs = [
        torch.cat([torch.arange(j * k, (j + 1) * k), pairs + torch.arange(j * k, (j + 1) * k)])
        for j in range(n_microbatches)
    ]
    return torch.cat(runs)


def with_reference(targets: torch.Tensor, ref_logps: Optional[torch.Tensor]) -> torch.Tensor:
    """(rows, S) int64 targets, plus a last column carrying each row's reference log-prob (float64
    bits, exact) when there is one."""
    if ref_logps is None:
        return targets
    bits = ref_logps.to(device=targets.device, dtype=torch.float64).view(torch.int64)
    return torch.cat([targets, bits.unsqueeze(1)], dim=1)


def split_reference(target: torch.Tensor, has_reference: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The inverse of `with_reference` on one pipeline micro-batch's rows."""
    if not has_reference:
        return target, None
    return target[:, :-1], target[:, -1].contiguous().view(torch.float64).float()


class PreferencePipelineLoss:
    """The last stage's loss_fn for a preference objective. torch also calls loss_fn once on the first
    step's placeholder outputs (backward metadata), before the real micro-batches: the step takes the
    statistics of the last `n` calls (`take_stats`)."""

    def __init__(self, objective: Any, scale: float, has_reference: bool, head: Any) -> None:
        self.objective, self.scale, self.has_reference = objective, scale, has_reference
        self.head = head  # the stage's HeadLoss: the per-token values, chunked or from the logits
        self._stats: list[torch.Tensor] = []

    @property
    def head_kwargs(self) -> dict[str, bool]:
        """The last stage's forward's `head` argument, if any (HeadLoss.head_kwargs)."""
        return self.head.head_kwargs

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        targets, ref = split_reference(target, self.has_reference)
        loss, stats = self.objective(output, targets, ref, self.head.token_nll)
        self._stats.append(stats)
        return loss * self.scale

    def take_stats(self, n: int, device: torch.device) -> torch.Tensor:
        """The summed statistics of the last `n` pipeline micro-batches (zeros on a rank without the
        last stage, so every rank hands the loop a vector of the same length)."""
        got, self._stats = self._stats[-n:] if n else [], []
        return torch.stack(got).sum(0) if got else torch.zeros(self.objective.stats_len, device=device)


def pipeline_batch(
    rt: Any, batch: MicroBatch, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one preference micro-step for the schedule (`batch`'s rows, on the device): rows
    regrouped per pipeline micro-batch, the targets carrying the reference's log-probs (DPO)."""
    from dtlaunch.train.parallel.parallelize import compute_context

    order = pair_rows(inputs.shape[0] // 2, rt.decisions.pp_microbatches).to(inputs.device)
    ref = None
    if rt.reference is not None:  # in the contexts the policy's forward and loss run in
        with rt.loss_context(), compute_context(rt.model_parts, rt.cfg, rt.device):
            ref = rt.reference(inputs, targets, batch)
    return inputs[order], with_reference(targets[order], ref[order] if ref is not None else None)
