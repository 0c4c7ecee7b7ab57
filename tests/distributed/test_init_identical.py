"""After parallelize + init, every rank's parameters are slices of the single-process init.

`_worker` (below) runs on torchrun's ranks, forked from pytest (forked_ranks.run_ranks): for each layout,
gather every parameter to its full value and compare it (bit for bit) with `Llama.init_weights(seed)` of a
plain one-process model; compare the full values across all ranks too, so data-parallel replicas provably
start identical.
"""

from __future__ import annotations

import os

import pytest
from forked_ranks import run_ranks

LAYOUTS = {
    "zero3": ["strategy=zero3"],
    "fsdp_tp": ["strategy=fsdp_tp"],
}


def _worker(overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.parallel.init_weights import model_param_name
    from dtlaunch.train.parallel.mesh import build_mesh
    from dtlaunch.train.parallel.parallelize import parallelize
    from dtlaunch.train.parallel.process_group import init_distributed, shutdown

    world = int(os.environ["WORLD_SIZE"])
    cfg = compose(["model=tiny", f"launch.nproc_per_node={world}", *overrides]).cfg
    env = init_distributed(cfg)
    layout = Layout.resolve(cfg.strategy, world)
    model = parallelize(build_model(cfg.model), build_mesh(layout, "cpu"), cfg, Decisions.of(cfg, layout))
    ref = build_model(cfg.model, device="cpu")
    ref.init_weights(int(cfg.training.seed))
    want = dict(ref.named_parameters())
    seen = set()
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        key = model_param_name(name)
        seen.add(key)
        assert torch.equal(full, want[key]), f"rank {env.rank}: {key} differs from the one-process init"
        gathered = [torch.empty_like(full) for _ in range(world)]
        dist.all_gather(gathered, full.contiguous())
        assert all(torch.equal(g, full) for g in gathered), f"{key} differs across ranks"
    assert seen == set(want), set(want) ^ seen
    shutdown()


# DDP, ZeRO-2 and HSDP start from the same init code path; their loss parity with one process
# (tests/e2e/test_train_ddp_fsdp.py) would fail at step 1 otherwise. Sharded DTensor layouts run here.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_identical(name: str) -> None:
    nproc = 4 if name in ("hsdp", "fsdp_tp") else 2
    proc = run_ranks(nproc, lambda: _worker(LAYOUTS[name]), env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
