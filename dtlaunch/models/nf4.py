"""QLoRA's frozen base: linear weights stored as torchao's NF4 tensor (4-bit NormalFloat, double-quantised
block scales), computed in the activations' dtype.

An NF4 weight is an `nn.Parameter` with requires_grad=False whose value is a torchao `NF4Tensor`;
`F.linear` on it is torchao's `linear_nf4` (dequantise to the input's dtype, matmul; the backward gives
the input's gradient only), so `nn.Linear` and the LoRA linear run on it unchanged.

Layout of one NF4 tensor of n elements (block b, scaler block s): `quantized_data` n/2 uint8 (two 4-bit
codes a byte), `quantized_scalers` n/b int8 (each block's absmax, minus their mean, quantised again),
`quantization_factor` n/(b*s) values in the tensor's dtype, `scaler_mean` one value and the 16-entry
code table. Sharding splits the first three along rows; the mean and the table are the whole tensor's,
so a shard is cut from the quantised full tensor (quantising each shard alone would give each its own
mean, which the gathered tensor cannot carry).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Iterator

import torch
from torch import nn

# The three inner tensors that a row split divides; the other two are per-tensor metadata.
SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")


def _torchao_nf4() -> ModuleType:
    """torchao's NF4 module (moved from torchao.dtypes in newer releases)."""
    try:
        return importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except ImportError:
        return importlib.import_module("torchao.dtypes.nf4tensor")


def nf4_class() -> type:
    return _torchao_nf4().NF4Tensor


def is_nf4(t: object) -> bool:
    """Whether `t` is an NF4 tensor, without importing torchao on runs that never loaded it."""
    if "torchao" not in sys.modules:
        return False
    return isinstance(t, nf4_class())


def to_nf4(weight: torch.Tensor, block_size: int, scaler_block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (2-D) in `dtype`, quantised to NF4; its dtype is the one it dequantises to."""
    return _torchao_nf4().to_nf4(weight.detach().to(dtype).contiguous(), block_size, scaler_block_size)


def nf4_fits(numel: int, block_size: int, scaler_block_size: int) -> bool:
    """torchao's double quantisation needs whole blocks and whole scaler blocks."""
    return numel % block_size == 0 and (numel // block_size) % scaler_block_size == 0


def frozen_block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The linears of the decoder blocks whose weight is frozen (the base QLoRA quantises): 2-D weights
    of modules with a `weight` and an `in_features`, under `model.layers`. Embedding, output head and
    norms stay in their dtype, as in QLoRA. So does a linear with one output (a per-token scalar gate:
    Qwen3-Next's and Qwen3.5-MoE's shared-expert gate, `dim` parameters a block): a single row cannot be
    cut into FSDP row shards of whole NF4 blocks, and it is not among the linears the planner counts
    (ModelSpec.block_linears), so every layout keeps it in the compute dtype alike."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return
    for name, mod in layers.named_modules(prefix="layers"):
        w = getattr(mod, "weight", None)
        if (
            isinstance(w, nn.Parameter)
            and w.dim() == 2
            and w.shape[0] > 1
            and hasattr(mod, "in_features")
            and not w.requires_grad
        ):
            yield name, mod


def nf4_blocks_problem(model: nn.Module, block_size: int, scaler_block_size: int, shards: int) -> str:
    """Why a frozen block linear of `model`, cut into `shards` row shards (FSDP's), does not hold whole NF4
    blocks: the first such weight, with the fix; "" when every one does. Checked by validate (on the meta
    model, dtlaunch.job.rules.qlora) and again by the worker before it quantises."""
    for name, mod in frozen_block_linears(model):
        rows, cols = mod.weight.shape
        if rows % shards or not nf4_fits(rows // shards * cols, block_size, scaler_block_size):
            return (
                f"{name}.weight {rows}x{cols} in {shards} row shard(s) does not hold whole NF4 blocks of "
                f"peft.nf4_block_size={block_size} x peft.nf4_scaler_block_size={scaler_block_size} elements; "
                f"choose sizes whose product divides {rows // shards * cols if rows % shards == 0 else cols}"
            )
    return ""


def quantize_frozen_linears(
    model: nn.Module, block_size: int, scaler_block_size: int, dtype: torch.dtype, shards: int = 1
) -> list[str]:
    """Replace each frozen block linear's weight by its NF4 form (on the weight's device, meta included:
    values come later, see dtlaunch.train.parallel.qlora). `shards`: how many row shards the weight will be cut
    into, each of which must hold whole blocks. Returns the quantised weights' names."""
    from dtlaunch.errors import ConfigError

    problem = nf4_blocks_problem(model, block_size, scaler_block_size, shards)
    if problem:
        raise ConfigError(problem)
    names = []
    for name, mod in list(frozen_block_linears(model)):
        mod.weight = nn.Parameter(to_nf4(mod.weight, block_size, scaler_block_size, dtype), requires_grad=False)
        names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_nf4_rows(local: torch.Tensor, full: torch.Tensor, index: int, count: int) -> None:
    """Give the NF4 tensor `local` (row shard `index` of `count`, possibly freshly `to_empty`-ed) the
    value of the quantised full weight `full`'s rows: copies the codes and scales of those rows, and
    sets the whole tensor's mean and code table (which `to_empty` left on the meta device)."""
    part = torch.chunk(full, count, dim=0)[index] if count > 1 else full
    for attr in SHARDED_PARTS:
        getattr(local, attr).copy_(getattr(part, attr))
    local.scaler_mean = full.scaler_mean.to(local.quantized_data.device)
    local.nf4 = full.nf4.to(local.quantized_data.device)


def allocate_nf4_metadata(t: torch.Tensor, device: torch.device) -> None:
    """The whole tensor's mean and code table, which `to_empty` leaves on the meta device, allocated on
    `device` without values (`plan --trace`; a real run gets them from load_nf4_rows)."""
    for attr in ("scaler_mean", "nf4"):
        value = getattr(t, attr)
        if value.device != device:
            setattr(t, attr, torch.empty_like(value, device=device))
