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

Under `training.compile` (full activation checkpointing only, config.decisions.offload_composes_with_compile)
the hooks sit on the eager checkpoint wrapper and the block inside it is what is compiled
(train.parallel.parallelize.apply_compile): the checkpoint saves the block input through these hooks
outside the compiled graph, and the compiled block runs again for the recompute in backward.

On a CPU run host and device are the same memory: packing keeps the tensor as it is (nothing to copy),
so the hook path and its accounting run without moving bytes; `copy=True` makes it copy each storage
and rebuild the saved views from the copy in backward, as on CUDA (minus streams and pinning). `packed_bytes` and `peak_held_bytes` are
what the plan's host line is checked against (tests/unit/test_activation_offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class _Storage:
    """One device storage while it is offloaded (shared by every saved view of it)."""

    host: torch.Tensor  # CUDA: pinned uint8 copy of the whole storage; CPU: a tensor over the storage itself
    nbytes: int
    views: int  # saved tensors over this storage not yet unpacked
    copied: bool = False  # `host` is a copy (the device storage may be gone)
    event: Optional[Any] = None  # CUDA: the device-to-host copy's completion
    device_copy: Optional[torch.Tensor] = None  # CUDA, in backward: the storage back on the device


@dataclass
class _Packed:
    """One saved tensor while it is offloaded: a view of an offloaded storage."""

    storage: _Storage
    tensor: Optional[torch.Tensor]  # CPU: the tensor itself (nothing moves)
    view: tuple  # (dtype, storage offset, size, stride)
    dtensor: Optional[tuple] = None  # (mesh, placements, shape, stride) of a DTensor's local part


@dataclass
class ActivationOffloader:
    """The hooks and their byte counts for one model."""

    device: torch.device
    # Copy each storage (a pinned host copy on CUDA, a plain copy on CPU) or keep the tensor (CPU default:
    # host and device are the same memory). None: copy on CUDA only.
    copy: Optional[bool] = None
    packed_bytes: int = 0  # storage bytes packed since the last `reset_counts`
    held_bytes: int = 0  # bytes on the host now
    peak_held_bytes: int = 0
    _skip: set = field(default_factory=set)  # storages of the block's shared arguments
    _block: dict = field(default_factory=dict)  # storage key -> _Storage packed inside the running block
    _keep: list = field(default_factory=list)  # CUDA: the block's device tensors until it returns
    _stream: Optional[Any] = None
    _active: list = field(default_factory=list)  # entered hook contexts, innermost last

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        if self.copy is None:
            self.copy = self.device.type == "cuda"

    def reset_counts(self) -> None:
        self.packed_bytes = 0
        self.peak_held_bytes = self.held_bytes

    # ---- the block hooks ------------------------------------------------------------------------

    def enter(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook: the block's extra arguments are shared, not offloaded."""
        self._skip = {_storage_key(a) for a in args[1:] if isinstance(a, torch.Tensor)}
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self._active.append(ctx)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook (runs on exceptions too). The block's storages were referenced until here, so
        no storage was freed and its key reused inside it (see _storage_key); on CUDA their copies
        were recorded on the side stream, so dropping the references cannot free them early."""
        if self._active:
            self._active.pop().__exit__(None, None, None)
        self._skip, self._block, self._keep = set(), {}, []

    # ---- saved-tensor hooks ---------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if is_weight(t) or _storage_key(t) in self._skip:
            return t
        from torch.distributed.tensor import DTensor

        meta = None
        local = t
        if isinstance(t, DTensor):
            local = t.to_local()
            meta = (t.device_mesh, t.placements, t.shape, t.stride())
        key = _storage_key(local)
        stored = self._block.get(key)
        if stored is None:
            stored = self._offload(local)
            self._block[key] = stored
        stored.views += 1
        view = (local.dtype, local.storage_offset(), tuple(local.shape), local.stride())
        return _Packed(storage=stored, tensor=None if stored.copied else local, view=view, dtensor=meta)

    def _offload(self, t: torch.Tensor) -> _Storage:
        nbytes = t.untyped_storage().nbytes()
        stored = _Storage(host=t, nbytes=nbytes, views=0)
        if self.copy and t.device == self.device:
            self._to_host(t, stored)
        self.packed_bytes += nbytes
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return stored

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        stored = packed.storage
        local = packed.tensor if packed.tensor is not None else self._view(packed)
        stored.views -= 1
        if stored.views == 0:
            self.held_bytes -= stored.nbytes
            stored.device_copy = None
        if packed.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = packed.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    # ---- CUDA copies ----------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor, stored: _Storage) -> None:
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        stored.copied = True
        # Referenced until the block returns, so that no later storage of the block reuses its key (the
        # block's storage table is keyed by it: _storage_key).
        self._keep.append(flat)
        if self._stream is None:  # CPU: a plain copy, already where backward reads it
            stored.host = flat.clone()
            return
        stream, compute = self._stream, torch.cuda.current_stream(t.device)
        host = torch.empty(stored.nbytes, dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(compute)  # the copy reads what the compute stream has written
        with torch.cuda.stream(stream):
            host.copy_(flat, non_blocking=True)
            stored.event = torch.cuda.Event()
            stored.event.record(stream)
        flat.record_stream(stream)  # the device memory is not reused before the copy has read it
        stored.host = host

    def _view(self, packed: _Packed) -> torch.Tensor:
        stored = packed.storage
        if stored.device_copy is None:
            stored.device_copy = self._to_device(stored)
        dtype, offset, size, stride = packed.view
        out = torch.empty(0, dtype=dtype, device=self.device)
        return out.set_(stored.device_copy.untyped_storage(), offset, size, stride)

    def _to_device(self, stored: _Storage) -> torch.Tensor:
        if self._stream is None:
            return stored.host
        stream, compute = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # the device buffer is allocated after the compute stream's frees
        with torch.cuda.stream(stream):
            stream.wait_event(stored.event)
            dev = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(stored.host, non_blocking=True)
        compute.wait_stream(stream)  # backward reads the copy only once it has landed
        dev.record_stream(compute)
        return dev


# Autograd nodes of a weight's transpose, view or cast (autocast's compute-dtype copy) on its way to a
# matmul: what a block saves that is a parameter, not an activation.
_WEIGHT_PATH = {"TBackward0", "ViewBackward0", "ToCopyBackward0", "PermuteBackward0", "TransposeBackward0"}


def is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cast of one (kept on the device: it is not freed by
    moving it, the parameter or autocast's cast cache still holds it)."""
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return True
    node = t.grad_fn
    for _ in range(4):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return True
        if name not in _WEIGHT_PATH or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def _storage_key(t: Any) -> int:
    """The storage's identity (its StorageImpl's address), shared by every view of it. Not its data
    address: a fake tensor (`plan --trace`) or a meta one has none (every one reads 0, so all would match
    the block's shared arguments and none would be packed)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage()._cdata


def apply_activation_offload(
    model: nn.Module, device: torch.device, copy: Optional[bool] = None
) -> ActivationOffloader:
    """Offload the saved activations of every block of `model.layers` (after activation checkpointing
    wrapped them, so that a checkpointed block's input is what moves). The offloader is also kept as
    `model.activation_offloader` for measurements."""
    off = ActivationOffloader(device=device, copy=copy)
    for block in model.layers.values():
        block.register_forward_pre_hook(off.enter)
        block.register_forward_hook(off.leave, always_call=True)
    model.activation_offloader = off
    return off
