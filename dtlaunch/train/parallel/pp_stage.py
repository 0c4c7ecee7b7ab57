"""The pipeline stage, with FSDP's gradient policy across micro-batches (`strategy.pp_reshard_grads`).

torch's PipelineStage turns an FSDP module's gradient sync and resharding off before every
micro-batch's backward and runs both once after the step's last backward (`perform_reduce_grad`): the
stage's gradients accumulate unsharded (and ZeRO-3 parameters stay gathered) across the micro-batches,
then one reduce-scatter. That is `pp_reshard_grads=false`, the plain PipelineStage.

`pp_reshard_grads=true` keeps FSDP's own behaviour inside every backward instead, as in a
non-pipelined accumulation micro-step: each block reduce-scatters its gradients and reshards its
parameters as soon as its backward is done, into sharded gradients that accumulate across the
micro-batches. The end-of-step `perform_reduce_grad` then finds nothing left to reduce.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

# The FSDPModule setters torch's stage calls with False around each backward.
_SYNC_SETTERS = ("set_is_last_backward", "set_requires_gradient_sync", "set_reshard_after_backward")


def set_fsdp_sync(module: FSDPModule, on: bool) -> None:
    """Reduce-scatter gradients and reshard parameters at the end of the next backward (`on`), or keep
    both unsharded for a later backward to add to."""
    for name in _SYNC_SETTERS:
        getattr(module, name)(on)


@contextlib.contextmanager
def _fsdp_sync_pinned_on(module: FSDPModule) -> Iterator[None]:
    set_fsdp_sync(module, True)
    # Instance attributes shadow the methods for the duration of the stage's backward, so that its
    # "sync off" calls do not undo the setting.
    for name in _SYNC_SETTERS:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in _SYNC_SETTERS:
            delattr(module, name)


class ReshardingStage(PipelineStage):
    """A PipelineStage whose FSDP module reduce-scatters after every micro-batch's backward."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full":
            # Validation refuses split-backward schedules with pp_reshard_grads (config.validate).
            raise RuntimeError(f"pp_reshard_grads needs full backward passes, got a '{backward_type}' pass")
        with _fsdp_sync_pinned_on(self.submod):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def make_stage(
    module: nn.Module, idx: int, n_stages: int, device: Any, group: Any, reshard_grads: bool
) -> PipelineStage:
    """The pipeline stage for one stage module under the configured gradient policy."""
    cls = ReshardingStage if reshard_grads and isinstance(module, FSDPModule) else PipelineStage
    return cls(module, idx, n_stages, device, group=group)
