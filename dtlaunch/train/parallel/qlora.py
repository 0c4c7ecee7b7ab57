"""QLoRA in the runtime: the frozen base linears become NF4 (dtlaunch.models.nf4) on the meta device,
before FSDP2 shards them; their values are set while the model is materialised; DDP leaves them out.

Order in dtlaunch.train.parallel.parallelize: LoRA adapters -> `quantize_base` (meta NF4 weights) -> FSDP2 ->
materialise + init, where `load_nf4_param` gives each NF4 weight its value -> DDP (`ddp_skip_nf4`).

- FSDP2 shards an NF4 weight through the tensor's own `fsdp_pre_all_gather` / `fsdp_post_all_gather`:
  each rank holds its rows' 4-bit codes and scales, and the all-gather moves those bytes (FSDP packs
  the mixed-dtype inputs as uint8), never a higher-precision copy.
- A sharded weight is quantised whole (from the seeded init or the Hugging Face file, one weight at a
  time) and this rank's rows are cut from it: the shards then carry the full tensor's scale mean, and
  the gathered weight equals what one process quantises.
- DDP would broadcast every parameter at construction; NF4 weights are frozen and computed identically
  on every rank, so DDP is told to ignore them (no broadcast, no gradient bucket).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.models.nf4 import is_nf4, load_nf4_rows, quantize_frozen_linears, to_nf4

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def uses_qlora(cfg: JobConfig) -> bool:
    return str(cfg.peft.method) == "qlora"


def quantize_base(model: nn.Module, cfg: JobConfig, shards: int) -> list[str]:
    """Under peft.method=qlora, the frozen block linears of `model` (on meta) become NF4 weights in the
    compute dtype (precision.param_dtype), so they dequantise straight to what the matmul uses.
    `shards`: the FSDP shard count (1 without FSDP)."""
    if not uses_qlora(cfg):
        return []
    p = cfg.peft
    dtype = torch_dtype(cfg.precision.param_dtype)
    return quantize_frozen_linears(model, int(p.nf4_block_size), int(p.nf4_scaler_block_size), dtype, shards)


@torch.no_grad()
def load_nf4_param(param: torch.Tensor, name: str, src: Any, seed: int, pretrained: Any = None) -> bool:
    """If `param` is (or shards) an NF4 weight, give it the quantised value of the whole weight `name`
    (from `pretrained`'s file, else `src.init_param`; computed only here) and return True; else return
    False and touch nothing."""
    # The DTensor's own local tensor (FSDP2 gathers from it), not `to_local()`'s new wrapper around the
    # same data: the mean and code table are set as attributes.
    local = param._local_tensor if isinstance(param, DTensor) else param
    if not is_nf4(local):
        return False
    value = pretrained.read(name) if pretrained is not None else src.init_param(name, tuple(param.shape), seed)
    full = to_nf4(value, local.block_size, local.scaler_block_size, local.dtype)
    index, count = 0, 1
    if isinstance(param, DTensor):
        rows = local.shape[0]
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        index, count = offset[0] // rows, param.shape[0] // rows
    load_nf4_rows(local, full, index, count)
    return True


def ddp_skip_nf4(model: nn.Module) -> None:
    """Tell DDP (constructed next) to leave the NF4 weights alone: no broadcast at construction (every
    rank quantised the same value) and no gradient buckets (they are frozen)."""
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, p in model.named_parameters() if is_nf4(p)]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
