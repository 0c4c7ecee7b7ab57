"""Activation offloading (`training.activation_offload`): the blocks' saved activations live in host memory
between a block's forward and its backward.

Each block's forward runs under `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves
inside it (under activation checkpointing: the checkpointed block input, which torch's checkpoint saves
through the same hooks; the tensors inside a checkpointed region are the checkpoint's own) is packed to
the host and unpacked back when backward needs it. The output head's and the loss's activations are not
inside a block and stay on the device. Parameters and the tensors a block receives besides its hidden
state (RoPE tables, masks, shared by every block) are never moved.

On CUDA the copies run on a side stream: device-to-host in forward (the side stream first waits for the
compute stream, so the copy reads finished data; `record_stream` keeps the device memory from being
reused until the copy is done), host-to-device in backward (the compute stream waits for the side stream
before it reads the result, and the result is recorded on the compute stream). Every hand-over between
the two streams is an explicit wait, which is what tensor-parallel runs need (collectives enqueued on the
compute stream read these tensors). Host buffers are pinned, so the copies are asynchronous.

On a CPU run host and device are the same memory: packing keeps the tensor as it is (nothing to copy),
so the hook path and its accounting run without moving bytes. `packed_bytes` and `peak_held_bytes` are
what the plan's host line is checked against (tests/unit/test_activation_offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class _Packed:
    """One saved tensor while it is offloaded."""

    host: torch.Tensor  # pinned host copy (CUDA) or the tensor itself (CPU)
    nbytes: int
    device: torch.device
    event: Optional[Any] = None  # CUDA: the device-to-host copy's completion
    dtensor: Optional[tuple] = None  # (mesh, placements, shape, stride) of a DTensor's local part


@dataclass
class ActivationOffloader:
    """The hooks and their byte counts for one model."""

    device: torch.device
    packed_bytes: int = 0  # bytes packed since the last `reset_counts` (every block, every micro-batch)
    held_bytes: int = 0  # bytes on the host now
    peak_held_bytes: int = 0
    _skip: set = field(default_factory=set)  # storages of the block's shared arguments
    _stream: Optional[Any] = None
    _active: list = field(default_factory=list)  # entered hook contexts, innermost last

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    def reset_counts(self) -> None:
        self.packed_bytes = 0
        self.peak_held_bytes = self.held_bytes

    # ---- the block hooks ------------------------------------------------------------------------

    def enter(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook: the block's extra arguments are shared, not offloaded."""
        self._skip = {_storage_ptr(a) for a in args[1:] if isinstance(a, torch.Tensor)}
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self._active.append(ctx)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook (runs on exceptions too)."""
        if self._active:
            self._active.pop().__exit__(None, None, None)
        self._skip = set()

    # ---- saved-tensor hooks ---------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or _storage_ptr(t) in self._skip:
            return t
        from torch.distributed.tensor import DTensor

        meta = None
        local = t
        if isinstance(t, DTensor):
            local = t.to_local()
            if isinstance(local, nn.Parameter):
                return t
            meta = (t.device_mesh, t.placements, t.shape, t.stride())
        nbytes = local.numel() * local.element_size()
        packed = _Packed(host=local, nbytes=nbytes, device=local.device, dtensor=meta)
        if self._stream is not None and local.is_cuda:
            self._to_host(local, packed)
        self.packed_bytes += nbytes
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self.held_bytes -= packed.nbytes
        local = packed.host
        if packed.event is not None:
            local = self._to_device(packed)
        if packed.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = packed.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    # ---- CUDA copies ----------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor, packed: _Packed) -> None:
        stream, compute = self._stream, torch.cuda.current_stream(t.device)
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
        stream.wait_stream(compute)  # the copy reads what the compute stream has written
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            packed.event = torch.cuda.Event()
            packed.event.record(stream)
        t.record_stream(stream)  # the device memory is not reused before the copy has read it
        packed.host = host

    def _to_device(self, packed: _Packed) -> torch.Tensor:
        stream, compute = self._stream, torch.cuda.current_stream(packed.device)
        stream.wait_stream(compute)  # the device buffer is allocated after the compute stream's frees
        with torch.cuda.stream(stream):
            stream.wait_event(packed.event)
            dev = torch.empty_strided(
                packed.host.shape, packed.host.stride(), dtype=packed.host.dtype, device=packed.device
            )
            dev.copy_(packed.host, non_blocking=True)
        compute.wait_stream(stream)  # backward reads the copy only once it has landed
        dev.record_stream(compute)
        return dev


def _storage_ptr(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.device.type != "meta" else -1


def apply_activation_offload(model: nn.Module, device: torch.device) -> ActivationOffloader:
    """Offload the saved activations of every block of `model.layers` (after activation checkpointing
    wrapped them, so that a checkpointed block's input is what moves). The offloader is also kept as
    `model.activation_offloader` for measurements."""
    off = ActivationOffloader(device=device)
    for block in model.layers.values():
        block.register_forward_pre_hook(off.enter)
        block.register_forward_hook(off.leave, always_call=True)
    model.activation_offloader = off
    return off
