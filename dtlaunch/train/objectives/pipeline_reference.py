"""DPO's live reference under pipeline parallel: a no-grad forward through the pipeline's own stages.

The reference is split as the policy is: a frozen copy's stage modules on the ranks that own those stages,
or, with LoRA / QLoRA and reference=base, the policy's own stage modules with their adapters switched off.
Before the schedule runs a micro-step, its rows go through the stages one pipeline micro-batch at a time,
in stage order: the rank that owns stage s runs it on what the owner of stage s - 1 sent (point to point
over the pipeline group) and sends its output on to the owner of stage s + 1. The last stage turns its
logits into completion log-probs and broadcasts them over the pipeline group, so every rank hands the same
(rows,) values to the schedule's targets (objectives/pipeline.py) and to the precompute pass.

Only one stage runs at a time. A chain has no send/recv order that can deadlock, whatever the placement
of the stages (looped, or V-shaped), and it keeps one micro-batch's hidden states in flight, which the
plan counts (dtlaunch.plan.objective). The price is time: up to pp times what an overlapped forward-only
schedule would take for the reference's share of the step; objective.precompute_reference removes it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from dtlaunch.models.lora import adapters_disabled
from dtlaunch.train.loss import completion_logps

# Dtypes a stage's output can have (its header carries the index).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 4


def stage_owners(pp: int, stages_per_rank: int, schedule_name: str) -> list[int]:
    """The pipeline rank that runs each stage, by stage index."""
    from dtlaunch.train.parallel.pipeline import stage_ids

    owners = [0] * (pp * stages_per_rank)
    for rank in range(pp):
        for stage in stage_ids(rank, pp, stages_per_rank, schedule_name):
            owners[stage] = rank
    return owners


class PipelineReference:
    """The reference log-probs of a micro-step's rows, computed through the pipeline's stages."""

    def __init__(
        self,
        stages: list[tuple[int, nn.Module]],
        owners: list[int],
        group: Any,
        n_microbatches: int,
        adapters_off: bool,
        head: Any,
    ) -> None:
        self.stages = dict(stages)  # stage index -> this rank's module
        self.head = head  # the last stage's HeadLoss (chunked or not), where this rank runs it
        self.owners, self.group, self.n_mb = owners, group, n_microbatches
        self.adapters_off = adapters_off
        self.me = dist.get_rank(group)
        # The memory tracker counts the reference's own modules: none when it is the policy itself.
        self.modules = [] if adapters_off else list(self.stages.values())

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: Any) -> torch.Tensor:
        """(rows,) fp32 completion log-probs of the rows of `inputs`, the same on every pipeline rank."""
        with self._switched():
            last = self.owners[-1]
            parts = [
                self._run_chunk(x, y) for x, y in zip(inputs.chunk(self.n_mb), targets.chunk(self.n_mb), strict=True)
            ]
            out = torch.cat(parts) if self.me == last else torch.empty(inputs.shape[0], device=inputs.device)
        dist.broadcast(out, group=self.group, group_src=last)
        return out

    def _switched(self) -> contextlib.AbstractContextManager:
        """The adapters off on every local stage (reference=base with LoRA); nothing for a frozen copy."""
        stack = contextlib.ExitStack()
        if self.adapters_off:
            for module in self.stages.values():
                stack.enter_context(adapters_disabled(getattr(module, "module", module)))
        return stack

    def _run_chunk(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """One pipeline micro-batch through every stage; its log-probs on the last stage's rank."""
        h: Optional[torch.Tensor] = None
        last = len(self.owners) - 1
        for s, owner in enumerate(self.owners):
            if owner != self.me:
                continue
            if s == 0:
                h = inputs
            elif self.owners[s - 1] != self.me:
                h = self._recv(self.owners[s - 1], inputs.device)
            module = self.stages[s]
            # The last stage's output as the loss takes it: the logits, or a chunked loss's hidden states.
            h = self.head.model_output(module, h) if s == last else module(h)
            if s == last:
                return completion_logps(h, targets, token_nll=self.head.token_nll).logps.float()
            if self.owners[s + 1] != self.me:
                self._send(h, self.owners[s + 1])
                h = None
        return None

    def _send(self, t: torch.Tensor, to: int) -> None:
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise RuntimeError(f"a pipeline stage's output of shape {tuple(t.shape)} and {t.dtype} cannot be sent")
        header = [t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim())), _DTYPES.index(t.dtype)]
        dist.send(torch.tensor(header, device=t.device), group=self.group, group_dst=to)
        dist.send(t.contiguous(), group=self.group, group_dst=to)

    def _recv(self, source: int, device: torch.device) -> torch.Tensor:
        header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=device)
        dist.recv(header, group=self.group, group_src=source)
        ndim, *rest = header.tolist()
        out = torch.empty(rest[:ndim], dtype=_DTYPES[rest[-1]], device=device)
        dist.recv(out, group=self.group, group_src=source)
        return out
