"""FSDP2 during objective=grpo's generation: the weights gathered once per rollout, not once per forward.

A rollout runs one forward per generated token (dtlaunch.infer.batch_generate). Units that reshard after
forward (ZeRO-3, the frozen ends of LoRA) would all-gather every block's parameters again for each of
them: max_completion_length all-gathers of the whole model per rollout, on the critical path. Inside
`gathered_for_generation` no unit reshards after forward, so the prefill gathers each unit once and the
decode steps reuse it; on exit every unit is resharded and its own setting restored, so training
starts from the shards as before. The plan holds the whole model gathered for the generation phase
(dtlaunch.plan.generation.gathered_bytes).

With objective.generation_gather=unit (ZeRO-3; chosen by the plan under `auto` when the whole model does
not fit beside the KV cache) the units keep their own setting: each forward gathers one unit at a time
and reshards it after, as in training, so the whole model is never held; on exit every unit is
resharded all the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_for_generation(model: nn.Module, whole: bool = True) -> Iterator[None]:
    units = fsdp_units(model)
    if not whole:
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()  # type: ignore[operator]
        return
    # fully_shard keeps each unit's setting as its param groups' post-forward mesh (None: no reshard)
    # and, for the root, an automatic flag; FSDPModule only offers a setter, so they are saved here.
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()  # type: ignore[operator]
        groups = [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]
        saved.append((state, state._auto_reshard_after_forward, groups))
        unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info
        for unit in units:
            unit.reshard()  # type: ignore[operator]
