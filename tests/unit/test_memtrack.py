"""StorageCounter / PeakTracker: the CPU peak-memory measurement the planner is checked against."""

import torch
from torch import nn

from dtlaunch.train.observe.memtrack import PeakTracker, StorageCounter, state_tensors

MiB = 2**20


def test_counts_allocations_frees_and_views_once():
    counter = StorageCounter()
    with counter:
        a = torch.empty(MiB, dtype=torch.uint8)
        view = a[: MiB // 2]  # shares a's storage: not counted again
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        assert counter.live == 3 * MiB
        del b
        assert counter.live == MiB
        c = torch.empty(MiB // 4, dtype=torch.float32)  # 1 MiB
        assert counter.live == 2 * MiB
    assert counter.peak == 3 * MiB
    del a, view, c
    assert counter.live == 0


def test_follows_storage_resizes_like_fsdp2_unsharded_parameters():
    # FSDP2 frees an unsharded parameter by resizing its storage to 0 and re-allocates it the same way:
    # no op goes through the dispatcher, so the counter must see resize_ itself.
    param = torch.empty(MiB, dtype=torch.uint8)
    param.untyped_storage().resize_(0)
    counter = StorageCounter()
    with counter:
        param.untyped_storage().resize_(MiB)
        assert counter.live == MiB
        param.untyped_storage().resize_(0)
        assert counter.live == 0
    assert counter.peak == MiB
    assert torch.UntypedStorage.resize_ is counter._orig_resize  # the patch is undone on exit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_peak_equals_torch_memtracker_on_the_same_step():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    _step(model, opt)  # Adam state exists from here on

    counter = StorageCounter()
    counter.add_existing(state_tensors([model], [opt]))
    with counter:
        _step(model, opt)

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        _step(model, opt)
    reference = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    assert counter.peak == reference, (counter.peak, reference)


def test_peak_tracker_grows_with_activations_and_stops_after_its_steps():
    def peak_for(batch: int) -> int:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = PeakTracker([model], [opt], enabled=True, track_steps=2, device="cpu")
        for step in range(3):
            with tracker.step(step):
                x = torch.randn(batch, 64)
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert tracker._counter is None  # left after track_steps: the rest of the run pays nothing
        return tracker.peak_bytes()

    small, large = peak_for(8), peak_for(1024)
    params = sum(p.numel() for p in _model().parameters()) * 4
    # weights + grads + two Adam moments + the foreach step's temporaries, at least
    assert small >= 4 * params
    # 1016 more samples keep at least their two 256-wide fp32 hidden activations alive in backward
    assert large - small >= 1016 * 256 * 4 * 2
