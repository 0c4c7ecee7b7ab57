"""Materialise a meta-device model and give every parameter its layout-independent initial value.

Each parameter (a plain tensor, or the local shard of a DTensor under FSDP/TP) is set to the matching
slice of the model's `init_param(name, full_shape, seed)` (its registry entry's seeded init): the full value is computed on CPU from the seed and
the parameter's *model* name, then `distribute_tensor` cuts this rank's shard from it. So every layout
starts from the weights a single process would have: the basis of loss parity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtlaunch.models.lora import is_adapter
from dtlaunch.models.nf4 import allocate_nf4_metadata, is_nf4
from dtlaunch.models.saved_tensors import model_param_name
from dtlaunch.models.score_head import SCORE_HEAD
from dtlaunch.train.parallel.qlora import load_nf4_param


@torch.no_grad()
def materialize_and_init(
    model: nn.Module, device: torch.device, seed: int, init_source: Any = None, weights: Any = None
) -> None:
    """`to_empty` on `device`, then initialise parameters (by name) and buffers (RoPE tables).

    init_source: the object whose `init_param` / `buffer_values` give values (the unwrapped model); defaults
    to `model` itself. weights: where the base's values come from instead of model.init_from's directory
    (an object with HFWeights' `read`, e.g. DPO's reference run: dtlaunch.convert.run_weights).
    """
    src = init_source if init_source is not None else model
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    _retie(model, shared)
    # model.init_from=hf:DIR: this rank's slices from a Hugging Face directory instead of the seeded init.
    from dtlaunch.convert.hf import hf_weights

    pretrained = weights if weights is not None else hf_weights(src.cfg)
    for name, p in model.named_parameters():
        pname = model_param_name(name)
        # Adapters (dtlaunch.models.lora) and objective=reward's scalar head (dtlaunch.models.score_head) are
        # not in the base's files: their init comes from init_param.
        from_base = pretrained is not None and not is_adapter(pname) and pname != SCORE_HEAD
        # QLoRA's NF4 weights: the whole weight quantised, then this rank's rows (dtlaunch.train.parallel.qlora).
        if load_nf4_param(p, pname, src, seed, pretrained if from_base else None):
            continue
        if isinstance(p, DTensor):
            local = p.to_local()
            if from_base:
                # Only this rank's block of the tensor is read from the safetensors file.
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local.copy_(pretrained.read(pname, tuple(shape), tuple(offset)).to(device=device, dtype=p.dtype))
                continue
            full = src.init_param(pname, tuple(p.shape), seed)
            # src_data_rank=None: every rank holds the same full value, so each cuts its own shard locally
            # instead of receiving it from rank 0 (one collective per parameter otherwise).
            shard = distribute_tensor(
                full.to(device=device, dtype=p.dtype), p.device_mesh, p.placements, src_data_rank=None
            )
            local.copy_(shard.to_local())
        else:
            full = pretrained.read(pname) if from_base else src.init_param(pname, tuple(p.shape), seed)
            p.copy_(full.to(device=device, dtype=p.dtype))
    _init_rope_buffers(model, src, device)
    if pretrained is not None:
        _load_buffers(model, pretrained, device)


def _load_buffers(model: nn.Module, pretrained: Any, device: torch.device) -> None:
    """Buffers the weight source holds (`buffers`: GLM-4.5's router correction bias), whole on every rank."""
    held = getattr(pretrained, "buffers", set())
    for name, buf in model.named_buffers():
        pname = model_param_name(name)
        if pname in held:
            buf.copy_(pretrained.read(pname).to(device=device, dtype=buf.dtype))


def allocate_without_values(model: nn.Module, device: torch.device) -> None:
    """`to_empty` without initial values (`plan --trace` under fake tensors). FSDP2's sharded (DTensor)
    parameters go through to_empty, whose hooks FSDP2 needs. Otherwise each parameter and buffer is
    replaced by an empty one: to_empty swaps tensors in place, and a fake tensor made under the mode
    (the frozen base in the compute dtype, QLoRA's NF4 weights, to_empty's own results) carries the
    mode's weak reference, which the swap refuses."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        model.to_empty(device=device)
        _allocate_nf4_metadata(model, device)
        return
    made: dict[int, Any] = {}  # tied parameters stay tied
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            setattr(mod, name, made[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            mod.register_buffer(
                name, torch.empty_like(b, device=device), persistent=name not in mod._non_persistent_buffers_set
            )
    _allocate_nf4_metadata(model, device)


def _allocate_nf4_metadata(model: nn.Module, device: torch.device) -> None:
    for p in model.parameters():
        # The DTensor's own local tensor (FSDP2 gathers from it), as load_nf4_param sets it.
        local = p._local_tensor if isinstance(p, DTensor) else p
        if is_nf4(local):
            allocate_nf4_metadata(local, device)


def _shared_parameters(model: nn.Module) -> list[list[str]]:
    """Names under which one Parameter is registered more than once (a head tied to the embedding)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, shared: list[list[str]]) -> None:
    """`to_empty` gives every module its own new tensor, splitting tied parameters: share them again."""
    for first, *others in shared:
        param = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, param)


def _init_rope_buffers(model: nn.Module, src: Any, device: torch.device) -> None:
    """Derived buffers (RoPE tables) from the model's own `buffer_values`, matched by name suffix."""
    values = src.buffer_values(device)
    for name, buf in model.named_buffers():
        clean = model_param_name(name)
        for suffix, value in values.items():
            if clean.endswith(suffix):
                buf.copy_(value)
