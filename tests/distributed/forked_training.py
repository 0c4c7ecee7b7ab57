"""Layout parity in-process: gloo workers forked from the pytest process run the runtime object
(`build_runtime`, then `train_step`) on seeded batches; one process trains the same steps with the same
code and no mesh. Forked workers start with torch and dtlaunch already imported (a torchrun launch spends
~5 CPU-seconds per process importing them), so one group can run many layouts in a few seconds.

Imported by the test modules of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class SeededBatches:
    """The loader's interface over one seeded global batch of `global_batch` x (seq_len + 1) tokens, the
    same every step (the loss must fall as it is learnt): data-parallel rank `dp_rank`'s micro-batches of
    it (the batch cut into dp x accumulation micro-batches, rank r taking the r-th run of them). Under
    context parallel (`cp_size` > 1) each row keeps this CP rank's load-balanced chunks and the model gets
    their positions, as the worker's loader hands them."""

    def __init__(
        self,
        global_batch: int,
        seq_len: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        vocab: int,
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        import torch

        self.gen = torch.Generator()
        self.global_batch, self.seq_len = global_batch, seq_len
        self.micro_batch, self.dp_rank, self.dp_size, self.vocab = micro_batch, dp_rank, dp_size, vocab
        self.pending: list = []
        self.model_args: dict = {}
        if cp_size > 1:
            from dtlaunch.train.parallel.context_parallel import local_positions

            self.model_args = {"positions": torch.from_numpy(local_positions(seq_len, cp_rank, cp_size))}

    def next_batch(self) -> Any:
        import torch

        from dtlaunch.train.batch import MicroBatch

        if not self.pending:
            shape = (self.global_batch, self.seq_len + 1)
            tokens = torch.randint(0, self.vocab, shape, generator=self.gen.manual_seed(7))
            chunks = tokens.view(-1, self.micro_batch, self.seq_len + 1)
            per_rank = chunks.shape[0] // self.dp_size
            self.pending = list(chunks[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank])
        t = self.pending.pop(0)
        inputs, targets = t[:, :-1], t[:, 1:]
        if self.model_args:
            keep = self.model_args["positions"]
            inputs, targets = inputs[:, keep], targets[:, keep]
        return MicroBatch(inputs, targets, model_args=self.model_args)


def one_process_runtime(cfg: object, device: object, prepare: Callable | None = None) -> object:
    """The single-process reference: one process, no mesh, the plain model with the runtime's init,
    optimizer, schedule and step. `prepare(model)` runs on the meta-device model before its init (a
    conversion the layouts also apply, e.g. float8)."""
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.features.moe_stats import RouterTracker
    from dtlaunch.train.features.peft import apply_peft
    from dtlaunch.train.objectives import build_objective
    from dtlaunch.train.objectives.reference import build_reference
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.init_weights import materialize_and_init
    from dtlaunch.train.runtime import Runtime

    t = cfg.training
    model = model_spec(cfg.model).build(cfg.model, rope_len=int(t.seq_len), device="meta")
    apply_peft(model, cfg)  # as the worker's build_model_parts does (no-op for peft.method=none)
    if prepare is not None:
        prepare(model)
    materialize_and_init(model, device, int(t.seed), init_source=model)
    opt = build_optimizer(model, cfg, device)
    dec = Decisions.of(cfg, Layout.resolve(cfg.strategy, 1))
    accum = dec.grad_accum
    return Runtime(
        cfg=cfg,
        decisions=dec,
        mesh=None,
        device=device,
        model_parts=[model],
        optimizers=[opt],
        schedulers=[build_scheduler(opt, cfg)],
        # An MoE model's aux-loss gradient scaled by 1 / accumulation steps, as the worker's runtime does.
        moe=RouterTracker.maybe(cfg, [model], None, 1, 1.0 / accum),
        objective=build_objective(cfg, dec, None),
        reference=build_reference(cfg, dec, None, [model]),
    )


def train(
    overrides: list[str],
    world: int,
    steps: int,
    inspect: Callable | None = None,
    make_batches: Callable | None = None,
    prepare: Callable | None = None,
    mesh: bool = False,
    convert: Callable | None = None,
) -> dict:
    """`steps` steps of the runtime's build and train_step; world 1 = the single-process reference, unless
    `mesh` (the worker's runtime on a 1-rank process group, as `launch.nproc_per_node=1` runs it).
    `inspect(runtime)` (every rank, after the last step) adds its JSON-able result under "inspect".
    `make_batches(cfg, global_batch, dp_rank, dp_size, cp_rank, cp_size)` replaces the seeded token
    batches (e.g. preference pairs; the config is then not validated, as its data section names no
    files); `prepare(runtime, batches)` runs once before the first step; `convert(model, cfg)` is the one
    process's conversion of the meta-device model that the workers' build_runtime applies itself (e.g.
    QLoRA's NF4 base)."""
    import torch
    import torch.distributed as dist

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate
    from dtlaunch.train.parallel.process_group import DistEnv
    from dtlaunch.train.step import train_step

    cfg = compose(overrides).cfg
    if make_batches is None:
        validate(cfg)
    device = torch.device("cpu")
    torch.manual_seed(int(cfg.training.seed))
    t = cfg.training
    gb = Decisions.of(cfg, Layout.resolve(cfg.strategy, world)).global_batch

    def batches(dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1) -> Any:
        if make_batches is not None:
            return make_batches(cfg, gb, dp_rank, dp_size, cp_rank, cp_size)
        vocab = int(cfg.model.vocab_size)
        return SeededBatches(gb, int(t.seq_len), int(t.micro_batch), dp_rank, dp_size, vocab, cp_rank, cp_size)

    if world > 1 or mesh:  # the worker's runtime object
        from dtlaunch.train.parallel.mesh import cp_rank_size, dp_rank_size
        from dtlaunch.train.runtime import build_runtime

        env = DistEnv(rank=dist.get_rank(), world=world, local_rank=0, restart=0, device=device, backend="gloo")
        rt = build_runtime(cfg, env)
        source = batches(*dp_rank_size(rt.mesh), *cp_rank_size(rt.mesh))
    else:
        model_prep = None if convert is None else (lambda m: convert(m, cfg))
        rt, source = one_process_runtime(cfg, device, prepare=model_prep), batches(0, 1)
    if prepare is not None:
        prepare(rt, source)
    losses, norms = [], []
    for step in range(1, steps + 1):
        r = train_step(rt, source, step)
        loss = r.local_loss.clone()
        if world > 1:  # the loop's mean over ranks (TP / PP ranks of a replica hold the same value)
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
        norms.append(float(r.grad_norm))
    out = {"loss": losses, "grad_norm": norms, "precision": str(cfg.precision.param_dtype)}
    if inspect is not None:
        out["inspect"] = inspect(rt)
    return out


def _forked(rank: int, world: int, port: int, out: str, run_all: Callable[[], dict]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = run_all()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_forked(world: int, run_all: Callable[[], dict], out: Path, timeout: float = 600) -> dict:
    """Fork `world` gloo workers that each call `run_all()` (every layout of the group, in order) and
    return rank 0's results. A worker's traceback fails the test; so does a group still running at `timeout`."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = (world, port, str(out), run_all)
    ctx = mp.start_processes(_forked, args=args, nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):  # raises with the worker's traceback if one fails
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the {world} forked workers did not finish within {timeout:.0f} s")
    return json.loads(out.read_text())
