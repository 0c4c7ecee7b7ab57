"""Tensor-parallel styles for LoRA linears (dtlaunch.models.lora), rewritten from the registry's plan.

torch's ColwiseParallel would shard every parameter of the module on dim 0 (lora_a [rank, in] on its
rank), and RowwiseParallel would replicate lora_a (an all-gather of the sharded input per call). The
Megatron split that keeps each rank's work local:
- column-wise (y sharded on out): weight, bias and lora_b [out, rank] Shard(0); lora_a replicated.
  x @ A^T is computed whole on each rank, then @ B^T gives this rank's output columns.
- row-wise (x sharded on in): weight and lora_a [rank, in] Shard(1); lora_b and bias replicated.
  x @ A^T is a partial sum over the ranks, and so is x @ W^T: both reach the output's all-reduce
  (or reduce-scatter) together, so the adapter adds no collective.
DTensor carries the placements through the forward, so the numerics are those of one process.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dtlaunch.models.lora import LoRALinear

_COLWISE = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}
_ROWWISE = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()}


def _distribute(module: nn.Module, mesh: Any, placements: dict, src_data_rank: Any) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _distribute(module, device_mesh, _COLWISE, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _distribute(module, device_mesh, _ROWWISE, self.src_data_rank)


def lora_tp_plan(plan: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """`plan` (names relative to `module`) with the LoRA styles on the adapted linears."""
    from dtlaunch.train.parallel.tp_restyle import restyle

    def swap(target: nn.Module, name: str, style: Any) -> Any:
        if not isinstance(target, LoRALinear):
            return style
        kind = type(style)
        if kind not in (ColwiseParallel, RowwiseParallel):
            raise NotImplementedError(f"no LoRA tensor-parallel style for {kind.__name__} on '{name}'")
        twin = LoRAColwiseParallel if kind is ColwiseParallel else LoRARowwiseParallel
        new = twin(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
        new.src_data_rank = style.src_data_rank
        return new

    return restyle(plan, module, swap)
