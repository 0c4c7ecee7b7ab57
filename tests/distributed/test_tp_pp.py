"""Tensor / pipeline parallel pieces (dtlaunch.train.parallel.tensor_parallel, pipeline, dtlaunch.train.loss, step) against one process.

Each case runs `_worker` (below) on torchrun's ranks, forked from pytest (forked_ranks.run_ranks; gloo, CPU).
The workers build the layout from the pieces (TP plan, stage split, FSDP), train a few SGD steps with grad
clipping on seeded batches, and rank 0 trains the same steps on a plain single-process model; the test
compares loss and grad norm. SGD rather than Adam: Adam is nearly invariant to the clipping factor, SGD shows
a wrong clip in the loss.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from forked_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512", "model.n_layers=4"]
DEEP = TINY[:-1] + ["model.n_layers=8"]
BASE = ["training.seq_len=32", "training.micro_batch=4", "training.steps=5", "strategy.zero_stage=0"]

CASES = {
    "pp_zbv": (
        2,
        DEEP
        + [
            "strategy.pp=2",
            "strategy.dp_shard=1",
            "strategy.pp_schedule=zbv",
            "strategy.pp_stages_per_rank=2",
            "strategy.pp_microbatches=4",
        ],
    ),
    "fsdp_tp": (4, TINY + ["strategy.tp=2", "strategy.dp_shard=2", "strategy.zero_stage=3"]),
}


def run_case(name: str, tmp_path: Path) -> dict:
    nproc, overrides = CASES[name]
    out = tmp_path / f"{name}.json"
    proc = run_ranks(nproc, lambda: _worker(out, [*BASE, *overrides]), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-9000:]
    return json.loads(out.read_text())


# tests/distributed/test_parallel_layouts.py runs the other layouts (loss and grad norm vs one process, Adam);
# here, with SGD so that a wrong clipping factor shows in the loss, the cases that are not there: the
# V-shaped ZBV schedule and FSDP x TP, whose grad norm needs the _StridedShard placement handled.


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_one_process(name: str, tmp_path: Path) -> None:
    r = run_case(name, tmp_path)
    assert len(r["loss"]) == 5
    loss_diff = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(r["grad_norm"], r["ref_grad_norm"], strict=True))
    assert loss_diff <= 1e-4, (r["loss"], r["ref_loss"])
    assert norm_diff <= 1e-4, (r["grad_norm"], r["ref_grad_norm"])
    # The loss must move, or equal losses would prove nothing about the updates.
    assert r["ref_loss"][0] - r["ref_loss"][-1] > 1e-3
    # Grad clipping (max_norm below) must really have been exercised.
    assert max(r["ref_grad_norm"]) > MAX_NORM


def test_stage_split_names_and_ownership() -> None:
    """Unit: stages keep the full model's parameter names; V-shaped and looped stage ids."""
    from omegaconf import OmegaConf

    from dtlaunch.config.layout import Layout
    from dtlaunch.job.model_schema import typed_job
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.parallel.pipeline import build_stage_modules, stage_ids

    cfg = typed_job(
        OmegaConf.from_dotlist(
            DEEP
            + [
                "strategy.pp=2",
                "strategy.pp_layers_per_stage=[1,2,3,2]",
                "strategy.pp_stages_per_rank=2",
                "strategy.pp_schedule=interleaved_1f1b",
            ]
        ),
    )
    layout = Layout(world=2, dp_replicate=1, dp_shard=1, tp=1, pp=2)
    model = build_model(cfg.model)
    names = set()
    for rank in range(2):
        for idx, part in build_stage_modules(model, cfg, layout, rank):
            assert (part.tok_embeddings is not None) == (idx == 0)
            assert (part.output is not None) == (idx == 3)
            names |= {n for n, _ in part.named_parameters()}
        assert [i for i, _ in build_stage_modules(model, cfg, layout, rank)] == [rank, rank + 2]
    assert names == {n for n, _ in model.named_parameters()}
    assert stage_ids(0, 2, 2, "zbv") == [0, 3] and stage_ids(1, 2, 2, "zbv") == [1, 2]


def test_bad_schedule_name_is_a_config_error() -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.train.parallel.pipeline import schedule_class

    assert schedule_class("1f1b").__name__ == "Schedule1F1B"
    assert schedule_class("DualPipeV").__name__ == "ScheduleDualPipeV"
    with pytest.raises(ConfigError, match="strategy.pp_schedule"):
        schedule_class("Schedule_nope")


# ----------------------------------------------------------------------------------------------------------
# Worker side (run under torchrun by run_case).

MAX_NORM = 0.5
LR = 0.5


def _batches(cfg, steps: int, global_batch: int):
    import torch

    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (global_batch, cfg.training.seq_len + 1), generator=g)
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _reference(cfg, steps: int, global_batch: int) -> tuple[list[float], list[float]]:
    import torch

    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.loss import cross_entropy

    model = build_model(cfg.model, rope_len=cfg.training.seq_len, device="cpu")
    model.init_weights(cfg.training.seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets in _batches(cfg, steps, global_batch):
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def _worker(out: Path, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import fully_shard

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.model_schema import typed_job
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.loss import HeadLoss, cross_entropy, loss_context, pipeline_loss_fn
    from dtlaunch.train.parallel.init_weights import materialize_and_init
    from dtlaunch.train.parallel.mesh import build_mesh, dp_rank_size, sub_mesh
    from dtlaunch.train.parallel.pipeline import build_schedule, build_stage_modules
    from dtlaunch.train.parallel.tensor_parallel import apply_tp
    from dtlaunch.train.step import clip_grad_norm

    cfg = typed_job(OmegaConf.from_dotlist(overrides))
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    layout = Layout.resolve(cfg.strategy, dist.get_world_size())
    mesh = build_mesh(layout, "cpu")
    tp_mesh, pp_mesh, fsdp_mesh = sub_mesh(mesh, "tp"), sub_mesh(mesh, "pp"), sub_mesh(mesh, "dp_shard")
    dp_rank, dp_size = dp_rank_size(mesh)

    model = build_model(cfg.model, rope_len=cfg.training.seq_len)
    parts = build_stage_modules(model, cfg, layout, pp_mesh.get_local_rank()) if pp_mesh else [(0, model)]
    for _, part in parts:
        if tp_mesh is not None:
            apply_tp(part, tp_mesh, cfg)
        if fsdp_mesh is not None:
            for block in part.layers.values():
                fully_shard(block, mesh=fsdp_mesh)
            fully_shard(part, mesh=fsdp_mesh)
        materialize_and_init(part, device, cfg.training.seed)
    modules = [part for _, part in parts]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    mb = cfg.training.micro_batch
    if pp_mesh is not None:
        dec = Decisions.of(cfg, layout)
        pp_loss = pipeline_loss_fn(HeadLoss(None, chunks=1), dec.pp_microbatches, grad_accum=1)
        plan = build_schedule(parts, pp_mesh, cfg, dec, pp_loss, device)

    losses, norms = [], []
    for inputs, targets in _batches(cfg, cfg.training.steps, mb * dp_size):
        x, y = inputs[dp_rank * mb : (dp_rank + 1) * mb], targets[dp_rank * mb : (dp_rank + 1) * mb]
        if pp_mesh is not None:
            loss = plan.forward_backward(pp_loss, x, y, pp_mesh, loss_context(cfg, layout))
        else:
            with loss_context(cfg, layout):
                loss = cross_entropy(modules[0](x), y)
                loss.backward()
            loss = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        norm = clip_grad_norm([m.parameters() for m in modules], MAX_NORM, pp_mesh)
        opt.step()
        opt.zero_grad()
        if dp_size > 1:
            dist.all_reduce(loss, group=fsdp_mesh.get_group())
            loss = loss / dp_size
        losses.append(float(loss))
        norms.append(float(norm))

    if dist.get_rank() == 0:
        ref_loss, ref_norm = _reference(cfg, cfg.training.steps, mb * dp_size)
        out.write_text(
            json.dumps({"loss": losses, "grad_norm": norms, "ref_loss": ref_loss, "ref_grad_norm": ref_norm})
        )
    # The runtime's own exit (barrier, destroy, os._exit): a gloo worker that unwinds the interpreter
    # normally sometimes dies in C++ teardown after its work is done (SIGABRT/SIGSEGV at exit).
    from dtlaunch.train.parallel.process_group import shutdown

    shutdown()
