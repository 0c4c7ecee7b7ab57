"""Expert parallel: each MoE layer's routed experts split over the EP ranks, tokens moved by all-to-all.

Only the `experts` submodule (dtlaunch.models.moe.experts.GroupedExperts) of each MoE layer changes:
its 3-D weights become DTensors sharded on the expert dimension (Shard(0) over the EP mesh), and
`torch.distributed.tensor.distribute_module` hooks wrap its call: dispatch before (tokens to the ranks
holding their experts), combine after (outputs back). The layer's router, shared experts and token
bookkeeping run as without EP, on this rank's tokens.

EP ranks are data-parallel ranks (taken from dp_shard): each sees different tokens, so an expert's
gradient sums the contributions of all EP ranks' tokens. FSDP then averages the experts' gradients over
the ranks left over (dp_shard / ep, x dp_replicate), not over all data-parallel ranks: the divide
factor is set to the whole data-parallel degree so that every parameter gets the global-batch mean
(dtlaunch.train.parallel.parallelize.apply_fsdp).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from dtlaunch.train.parallel.expert_dispatch import combine, dispatch


def routed_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-experts module of every MoE layer of `model` (a full model or a pipeline stage)."""
    from dtlaunch.models.moe.experts import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every routed-experts module's weights over `ep_mesh` and route its tokens by all-to-all."""
    for experts in routed_expert_modules(model):
        distribute_module(experts, ep_mesh, _shard_experts, _dispatch_inputs, _combine_outputs)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, p in list(module.named_parameters(recurse=False)):
        # src_data_rank=None: no scatter (the weights are still on the meta device; init fills them later).
        shard = distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(pname, nn.Parameter(shard, requires_grad=p.requires_grad))


def _dispatch_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x, counts = inputs
    rows, local_counts, plan = dispatch(x, counts, mesh.get_group())
    # A stack, not one slot: each forward pairs one dispatch with one combine, nested calls included.
    module.__dict__.setdefault("_ep_plans", []).append(plan)
    return rows, local_counts


def _combine_outputs(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return combine(output, module.__dict__["_ep_plans"].pop(), mesh.get_group())
