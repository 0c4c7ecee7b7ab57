"""The vocabulary-parallel token embedding (dtlaunch.train.parallel.tensor_parallel.VocabParallel), one process.

Rank `r` of a 4-way TP group is emulated with the fake process group. Its collectives move no data,
so the forward's summed output is not checked here; with a Replicate output the backward needs no
collective, so the gradient is exact. Numerics across real ranks: the TP loss-parity tests
(tests/distributed/test_parallel_layouts.py, tests/distributed/test_tp_pp.py)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtlaunch.train.observe.memtrack import StorageCounter
from dtlaunch.train.parallel.tensor_parallel import VocabParallel

V, H, TP = 1000, 64, 4  # 1000 rows over 4 ranks: 250 each


@pytest.fixture(params=[0, 3])
def rank(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=TP)
    yield request.param
    dist.destroy_process_group()


def _embedding(layout):
    torch.manual_seed(0)
    full = torch.nn.Embedding(V, H)
    tp = torch.nn.Embedding(V, H)
    tp.load_state_dict(full.state_dict())
    parallelize_module(tp, init_device_mesh("cpu", (TP,)), VocabParallel(layout))
    return full, tp


@pytest.mark.parametrize("layout", [Replicate(), Shard(1)])
def test_gradient_is_only_the_local_shard(rank, layout):
    full, tp = _embedding(layout)
    assert tp.weight.placements == (Shard(0),) and tp.weight.to_local().shape == (250, H)
    tokens = torch.randint(0, V, (2, 16))
    counter = StorageCounter()
    with counter:
        tp(tokens).sum().backward()
    # torch's RowwiseParallel returns a Replicate gradient: all V rows on every rank.
    assert tp.weight.grad.placements == (Shard(0),)
    assert tp.weight.grad.to_local().shape == (250, H)
    assert counter.peak < V * H * 4  # never a full-vocabulary tensor
    if layout == Shard(1):
        return  # the backward all-gathers: values undefined on a fake group
    full(tokens).sum().backward()
    torch.testing.assert_close(tp.weight.grad.to_local(), full.weight.grad[rank * 250 : (rank + 1) * 250])
