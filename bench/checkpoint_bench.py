"""Checkpoint cost on 2 ranks: sync save vs the time an async save blocks the training loop, load time,
bytes written. A ~110M-parameter Llama (dim 768, 12 layers, vocab 16000) under FSDP2, AdamW state included.

    python bench/checkpoint_bench.py [--nproc 2] [--repeats 3] [--out /tmp/ckpt-bench]

Not run by the tests (it takes minutes on a CPU). Prints the ratio async-blocking / sync (goal < 10 %).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = [
    "model=tiny",
    "model.dim=768",
    "model.n_layers=12",
    "model.n_heads=12",
    "model.n_kv_heads=12",
    "model.vocab_size=16000",
    "model.multiple_of=256",
    "training.seq_len=64",
    "training.micro_batch=1",
    "strategy.zero_stage=3",
    "strategy.dp_shard=-1",
    "hardware=cpu",
    "checkpoint.keep_last=1",
    "checkpoint.every_steps=1000000",
]


def _train_step(model: object, opt: object, cfg: object) -> None:
    import torch

    from dtlaunch.train.loss import cross_entropy

    tokens = torch.randint(0, int(cfg.model.vocab_size), (1, int(cfg.training.seq_len) + 1))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(out: Path, repeats: int) -> None:
    import torch.distributed as dist

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.models.shapes import human_count, param_count
    from dtlaunch.run.checkpoints import newest_complete
    from dtlaunch.train.checkpoint.manager import CheckpointManager
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.mesh import build_mesh
    from dtlaunch.train.parallel.parallelize import parallelize
    from dtlaunch.train.parallel.process_group import init_distributed

    results: dict[str, list[float]] = {
        "sync": [],
        "async_block": [],
        "async_total": [],
        "load": [],
        "step": [],
        "step_during_save": [],
    }
    for mode in ("sync", "async"):
        run_dir = out / mode
        cfg = compose([*MODEL, f"checkpoint.async_save={'true' if mode == 'async' else 'false'}"]).cfg
        if not dist.is_initialized():
            env = init_distributed(cfg)
        layout = Layout.resolve(cfg.strategy, env.world)
        model = parallelize(
            build_model(cfg.model, rope_len=int(cfg.training.seq_len)),
            build_mesh(layout, "cpu"),
            cfg,
            Decisions.of(cfg, layout),
        )
        opt = build_optimizer(model, cfg, env.device)
        sched = build_scheduler(opt, cfg)
        mgr = CheckpointManager(cfg, run_dir, [model], [opt], [sched], None, env.rank)
        _train_step(model, opt, cfg)
        for r in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _train_step(model, opt, cfg)
            results["step"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            blocked_before = mgr.blocked_s
            mgr.save(r + 1)
            if mode == "async":
                # The loop goes on while the copy and the write proceed; the optimizer step inside waits
                # for the copy to finish (that wait counts as blocking, in mgr.blocked_s).
                t1 = time.perf_counter()
                _train_step(model, opt, cfg)
                results["step_during_save"].append(time.perf_counter() - t1)
                results["async_block"].append(mgr.blocked_s - blocked_before)
                mgr.close()
                results["async_total"].append(time.perf_counter() - t0)
            else:
                dist.barrier()
                results["sync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        CheckpointManager(cfg, run_dir, [model], [opt], [sched], None, env.rank).resume()
        dist.barrier()
        results["load"].append(time.perf_counter() - t0)
        info, _ = newest_complete(run_dir / "checkpoints")
        nbytes = info.marker["bytes"] if info else 0
    if env.rank == 0:
        med = {k: statistics.median(v) for k, v in results.items() if v}
        print(
            f"model {human_count(param_count(cfg.model))} params, world {env.world} (FSDP2, gloo/CPU), "
            f"{nbytes / 2**20:.0f} MiB per checkpoint, {repeats} repeats (median)"
        )
        print(f"  sync save            {med['sync']:.2f} s  ({nbytes / 2**20 / med['sync']:.0f} MiB/s)")
        print(f"  async save, blocking {med['async_block']:.2f} s  (total until written {med['async_total']:.2f} s)")
        print(
            f"  train step {med['step']:.2f} s alone, {med['step_during_save']:.2f} s while the async save runs "
            f"(includes the wait for the copy; the writer shares the CPU)"
        )
        print(f"  load (resume)        {med['load']:.2f} s")
        print(f"  async blocking / sync = {med['async_block'] / med['sync']:.1%} (goal < 10 %)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/dtlaunch-ckpt-bench")
    args = ap.parse_args()
    out = Path(args.out)
    if "RANK" in os.environ:
        worker(out, args.repeats)
        return
    shutil.rmtree(out, ignore_errors=True)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        __file__,
        "--out",
        str(out),
        "--repeats",
        str(args.repeats),
    ]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
