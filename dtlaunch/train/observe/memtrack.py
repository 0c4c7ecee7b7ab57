"""Measured peak memory per rank: what the planner's prediction is checked against.

CUDA: the caching allocator's `max_memory_allocated` (tensor bytes, like the plan's main figure).
CPU: there is no allocator statistic, so tensor storages are counted by `StorageCounter`, a dispatch
mode that sees every op's outputs, over the first `track_steps` steps; after those the mode is left,
so the rest of the run pays nothing. The peak of a step appears from step 2 on (Adam state is created
by the first optimizer step), hence the default of 3 tracked steps.

Why not torch's MemTracker: it attributes memory to modules through forward/backward hooks, and those
hooks break pipeline schedules (a stage's backward never ran under it). Counting storages needs no
hooks, so it works the same for every layout, pipelines included; on non-pipeline runs it gives
MemTracker's peak (tests/unit/test_memtrack.py checks both on the same step).

Usage from the training loop:
    tracker = PeakTracker(model_parts, optimizers, enabled=True)
    with tracker.step(step):
        ...one whole optimizer step (forward, backward, optimizer.step, zero_grad)...
    tracker.peak_bytes()
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_iter


class StorageCounter(TorchDispatchMode):
    """Live bytes of every tensor storage on real devices, and their peak, while the mode is active.

    A storage is counted once (views and in-place results share it) from the op that creates it until
    it is freed (a weakref callback); `UntypedStorage.resize_` - how FSDP2 frees and re-allocates
    unsharded parameters - is not an op, so it is patched while the mode is active. Tensors that exist
    before entering are added with `add_existing`. Wrapper subclasses (DTensor) are skipped: their
    local tensors come through the dispatcher themselves. Meta tensors hold no memory; fake tensors
    are counted only for `fake_mode` (the planner's trace), and only ops run directly under it: DTensor
    propagates shardings under a fake mode of its own, on full unsharded shapes."""

    def __init__(self, fake_mode: Any = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize: Any = None

    # ---- counting -----------------------------------------------------------------------------

    def add_existing(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            self._count(t)
        self.peak = max(self.peak, self.live)

    def _count(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):
            inner, _ = t.__tensor_flatten__()
            for name in inner:
                self._count(getattr(t, name))
            return
        if isinstance(t, FakeTensor):
            if self.fake_mode is None:
                return
        elif t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes:
            return
        self._track(st, st.nbytes())

    def _track(self, st: torch.UntypedStorage, size: int) -> None:
        """Count `size` bytes for `st` until it is freed (a weakref callback)."""
        key = id(st)
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
        self.live += size

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _resized(self, st: torch.UntypedStorage, old: int) -> None:
        key = id(st)
        new = st.nbytes()
        if key not in self._sizes:
            if old != 0:
                return  # memory from before the mode that was never counted: its change is not either
            # An empty storage from before (FSDP2's unsharded parameter between steps) being allocated.
            self._track(st, 0)
        self.live += new - self._sizes[key]
        self._sizes[key] = new
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.fake_mode is not None:
            from torch._guards import active_fake_mode

            if active_fake_mode() is not self.fake_mode:
                return out
        for t in tree_iter(out):
            self._count(t)
        self.peak = max(self.peak, self.live)
        return out

    # ---- storage resizes ----------------------------------------------------------------------

    def __enter__(self) -> StorageCounter:
        self._orig_resize = torch.UntypedStorage.resize_
        orig, counter = self._orig_resize, self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            old = st.nbytes()
            res = orig(st, size)
            counter._resized(st, old)
            return res

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)


def state_tensors(model_parts: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> Iterator[torch.Tensor]:
    """Parameters, their gradients, buffers and optimizer state: what lives before a step starts."""
    for part in model_parts:
        for p in part.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from part.buffers()
    for opt in optimizers:
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class PeakTracker:
    def __init__(
        self,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[Any],
        enabled: bool = True,
        track_steps: int = 3,
        device: torch.device | str | None = None,
    ) -> None:
        self.enabled = enabled
        self.track_steps = track_steps
        self.model_parts = list(model_parts)
        # ZeroRedundancyOptimizer keeps the state in its inner optimizer.
        self.optimizers = [getattr(o, "optim", getattr(o, "optimizer", o)) for o in optimizers]
        self.device = torch.device(device) if device is not None else _device_of(self.model_parts)
        self._steps_seen = 0
        self._peak = 0
        # One counter over all tracked steps: what a step creates and keeps (optimizer state, FSDP's
        # unsharded parameter storages) stays counted in the next.
        self._counter = StorageCounter()
        if enabled and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap one whole train step; counts (on CPU) while fewer than `track_steps` were seen."""
        if not self.enabled or self.device.type == "cuda" or self._steps_seen >= self.track_steps:
            self._steps_seen += 1
            yield
            return
        counter = self._counter
        counter.add_existing(state_tensors(self.model_parts, self.optimizers))
        with counter:
            yield
        self._steps_seen += 1
        self._peak = max(self._peak, counter.peak)
        if self._steps_seen >= self.track_steps:
            self._counter = None  # its bookkeeping goes; the counted tensors are the model's own

    def peak_bytes(self) -> int:
        """Peak allocated tensor bytes on this rank so far (0 when disabled)."""
        if not self.enabled:
            return 0
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self._peak)


def _device_of(parts: Sequence[torch.nn.Module]) -> torch.device:
    for part in parts:
        for p in part.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.device.type != "meta":
                return local.device
    return torch.device("cpu")
