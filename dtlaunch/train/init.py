"""Materialise a meta-device model and give every parameter its layout-independent initial value.

Each parameter (a plain tensor, or the local shard of a DTensor under FSDP/TP) is set to the matching
slice of `Llama.init_param(name, full_shape, seed)`: the full value is computed on CPU from the seed and
the parameter's *model* name, then `distribute_tensor` cuts this rank's shard from it. So every layout
starts from the weights a single process would have: the basis of loss parity.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Prefixes added by wrappers (DDP, activation checkpointing, torch.compile) that the model's own
# parameter names do not have.
_WRAPPER_PARTS = re.compile(r"(^|\.)(module|_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")


def model_param_name(name: str) -> str:
    """'layers.0._checkpoint_wrapped_module.attention.wq.weight' -> 'layers.0.attention.wq.weight'."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int, init_source: Any = None) -> None:
    """`to_empty` on `device`, then initialise parameters (by name) and buffers (RoPE tables).

    init_source: the object whose `init_param` / `rope_tables` give values (the unwrapped Llama); defaults
    to `model` itself.
    """
    src = init_source if init_source is not None else model
    model.to_empty(device=device)
    # model.init_from=hf:DIR: full tensors from a Hugging Face export instead of the seeded init.
    from dtlaunch.convert.hf import cached_hf_weights

    pretrained = cached_hf_weights(src.cfg)
    for name, p in model.named_parameters():
        pname = model_param_name(name)
        full = pretrained[pname] if pretrained is not None else src.init_param(pname, tuple(p.shape), seed)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds the same full value, so each cuts its own shard locally
            # instead of receiving it from rank 0 (one collective per parameter otherwise).
            shard = distribute_tensor(
                full.to(device=device, dtype=p.dtype), p.device_mesh, p.placements, src_data_rank=None
            )
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full.to(device=device, dtype=p.dtype))
    _init_rope_buffers(model, src, device)


def _init_rope_buffers(model: nn.Module, src: Any, device: torch.device) -> None:
    from dtlaunch.models.llama import rope_cache

    cos, sin = rope_cache(src.cfg, src.rope_len, device)
    for name, buf in model.named_buffers():
        if name.endswith("rope_cos"):
            buf.copy_(cos)
        elif name.endswith("rope_sin"):
            buf.copy_(sin)
