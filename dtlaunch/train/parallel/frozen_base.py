"""The frozen base of a LoRA / QLoRA run, converted on the meta device before FSDP2 and materialisation.

Full training keeps fp32 master weights because the optimizer updates them; a frozen weight is never
updated, and every matmul reads it in the compute dtype (FSDP2's MixedPrecisionPolicy casts it, or
autocast does). So the frozen linears (the blocks' and the output head), the frozen embedding and an MoE
model's frozen routed experts (3-D `GroupedExperts` weights, most of its bytes: Qwen3-30B-A3B's are 29B
of 30B parameters) are stored in precision.param_dtype: half the bytes (Llama-3.1-8B's base: 16 GB
instead of 32 GB). Under QLoRA the blocks' 2-D linears become NF4 instead (dtlaunch.train.parallel.qlora);
the routed experts stay in the compute dtype. Norm gains stay fp32.

Without FSDP (autocast) the residual stream stays fp32: the compute-dtype embedding's output is cast back
to fp32 (its values are the compute-dtype embedding's, as an FSDP run reads them). With
optim.state_dtype=bf16 the trained parameters (the adapters, and a reward model's score head) are bf16 too
(so their gradients and AdamW moments are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.models.moe.experts import GroupedExperts
from dtlaunch.train.parallel.qlora import quantize_base

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def compute_dtype_weights(mod: nn.Module) -> tuple[str, ...]:
    """The weights of `mod` that a frozen model stores in the compute dtype: a linear's or an embedding's
    weight and bias, the routed experts' three and their biases (DPO's frozen reference copy too)."""
    if isinstance(mod, GroupedExperts):
        return ("w1", "w2", "w3", "b1", "b2", "b3")  # the biases: gpt-oss's
    return ("weight", "bias") if isinstance(mod, (nn.Linear, nn.Embedding)) else ()


def convert_frozen_base(model: nn.Module, cfg: JobConfig, shards: int, fsdp: bool = False) -> None:
    """peft.method=lora/qlora: frozen linear, embedding and routed-expert weights (and biases) to the compute
    dtype, then (qlora) the block linears to NF4. `shards`: the FSDP shard count (1 without FSDP); `fsdp`: FSDP2
    casts the compute (no autocast). Nothing under peft=none."""
    if str(cfg.peft.method) == "none":
        return
    dtype = torch_dtype(cfg.precision.param_dtype)
    counts = _uses(model)
    for mod in model.modules():
        for name in compute_dtype_weights(mod):
            p = getattr(mod, name, None)
            # A head tied to the embedding is trained or frozen with it and stays as it is (and tied).
            if isinstance(p, nn.Parameter) and not p.requires_grad and p.dtype != dtype and counts[id(p)] == 1:
                setattr(mod, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
        if isinstance(mod, nn.Embedding) and mod.weight.dtype != torch.float32 and not fsdp:
            mod.register_forward_hook(_to_fp32)
    if str(cfg.optim.state_dtype) == "bf16":
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p.requires_grad and p.dtype != torch.bfloat16:  # the adapters and modules_to_save
                    setattr(mod, name, nn.Parameter(p.detach().to(torch.bfloat16)))
    quantize_base(model, cfg, shards)


def frozen_ends(model: nn.Module, head: bool = True) -> list[nn.Module]:
    """The frozen, untied embedding and output head (absent on a pipeline stage that does not own them):
    under FSDP2 each is a unit of its own, gathered only while it runs (the head: its forward, or the
    chunked loss, which runs as the head unit's forward: dtlaunch.train.loss). head=False leaves
    the head to dtlaunch.train.parallel.head_unit, which decides whether it is a unit of its own."""
    counts = _uses(model)
    ends = []
    for name in ("tok_embeddings", "output") if head else ("tok_embeddings",):
        mod = getattr(model, name, None)
        params = list(mod.parameters()) if isinstance(mod, nn.Module) else []
        if params and not any(p.requires_grad for p in params) and all(counts[id(p)] == 1 for p in params):
            ends.append(mod)
    return ends


def _uses(model: nn.Module) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


def _to_fp32(_mod: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    return out.float()
