"""Where dtlaunch's per-step time goes, next to the hand-written loop's: a deterministic profile.

Builds both training setups in one process group (dtlaunch's through its own functions: compose,
parallelize, build_optimizer, build_loader, StepContext/train_step, MetricsLogger; the reference through
bench/handwritten.py's `build`) and times each piece of a step the two loops do differently, plus
the whole loop iteration. Every figure is the MINIMUM over many repetitions: the least time a piece
needs, which other processes on a busy machine can only inflate — so the comparison holds on a
machine that is not quiet, unlike wall-clock throughput.

    python bench/step_overhead.py                                   # world of 1
    torchrun --standalone --nproc-per-node 2 bench/step_overhead.py # DDP over 2 (adds the loss all-reduce)

Prints a JSON object (rank 0) with µs per call for each piece, and (`counts`) what one iteration of
each loop does, counted rather than timed, so the same on a quiet and a busy machine: Python function
calls (cProfile), aten ops and autograd nodes (torch.profiler), host reads of tensor values
(aten::_local_scalar_dense: `.item()`, `float(t)`, on a GPU each a stream sync) and collectives.
`--counts-only` skips the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def clock() -> Callable[[], float]:
    """CPU time of this thread in a world of one (what other processes on a busy machine inflate least);
    wall time when collectives are involved (waiting for a peer costs no CPU but does cost time)."""
    return time.thread_time if dist.get_world_size() == 1 else time.perf_counter


def best_us(fn: Callable[[], Any], inner: int, outer: int, together: bool = True) -> float:
    """Minimum over `outer` blocks of the mean time of `inner` calls, in microseconds."""
    best, now = float("inf"), clock()
    for _ in range(outer):
        if together and dist.get_world_size() > 1:
            dist.barrier()  # ranks start each block together, so collectives do not wait on stragglers
        t0 = now()
        for _ in range(inner):
            fn()
        best = min(best, (now() - t0) / inner)
    return best * 1e6


def counts(fn: Callable[[], Any], n: int = 5) -> dict[str, float]:
    """What one call of `fn` does, averaged over `n` calls: Python function calls, aten ops, autograd
    backward nodes, host reads of tensor values and collectives. Deterministic, unlike a timing."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(n):
            fn()
    events = {e.key: e.count for e in p.key_averages()}
    return {
        "python_calls": calls / n,
        "aten_ops": sum(c for k, c in events.items() if k.startswith("aten::")) / n,
        "autograd_nodes": sum(c for k, c in events.items() if k.startswith("autograd::engine::evaluate_function")) / n,
        "host_reads": events.get("aten::_local_scalar_dense", 0) / n,
        # One c10d:: op per collective call (the backend's own gloo:/nccl: event would count it twice).
        "collectives": sum(c for k, c in events.items() if k.startswith("c10d::")) / n,
        "ops": {k: c / n for k, c in sorted(events.items())},
    }


def init() -> tuple[int, int]:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def dtlaunch_side(recipe: str, world: int, run_dir: Path, extra: tuple[str, ...] = ()) -> tuple[Any, Any, Any, Any]:
    """(cfg, Runtime, loader, MetricsLogger, PeakTracker) as the worker's Trainer builds them."""
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.data import build_loader
    from dtlaunch.train.observe.memtrack import PeakTracker
    from dtlaunch.train.observe.metrics import MetricsLogger
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.mesh import build_mesh, dp_rank_size
    from dtlaunch.train.parallel.parallelize import parallelize
    from dtlaunch.train.runtime import Runtime

    cfg = compose(
        [f"recipe={recipe}", f"launch.nproc_per_node={world}", "checkpoint=none", "training.steps=100000", *extra]
    ).cfg
    dec = Decisions.of(cfg, Layout.resolve(cfg.strategy, world))
    mesh = build_mesh(dec.layout, "cpu")
    model = parallelize(build_model(cfg.model, rope_len=int(cfg.training.seq_len), device="meta"), mesh, cfg, dec)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    dp_rank, dp_size = dp_rank_size(mesh)
    rt = Runtime(
        cfg=cfg,
        decisions=dec,
        mesh=mesh,
        device=torch.device("cpu"),
        model_parts=[model],
        optimizers=[opt],
        schedulers=[build_scheduler(opt, cfg)],
    )
    loader = build_loader(cfg, run_dir, dp_rank, dp_size)
    metrics = MetricsLogger(run_dir, cfg, enabled=dist.get_rank() == 0)
    tracker = PeakTracker([model], [opt], enabled=True, device=torch.device("cpu"))
    return cfg, rt, loader, metrics, tracker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny_ddp")
    ap.add_argument("--outer", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--counts-only", action="store_true", help="only the per-iteration counts (no timings)")
    ap.add_argument("--ops", action="store_true", help="print every op's count per iteration, both loops")
    ap.add_argument("overrides", nargs="*", help="extra dtlaunch overrides, e.g. model=small")
    args = ap.parse_args()
    rank, world = init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from bench import handwritten
    from dtlaunch.train.step import clip_grad_norm, train_step
    from dtlaunch.train.step_sync import WindowSync

    run_dir = Path(tempfile.mkdtemp(prefix="dtlaunch-step-overhead-"))
    (run_dir / "logs").mkdir()
    cfg, rt, loader, metrics, tracker = dtlaunch_side(args.recipe, world, run_dir, tuple(args.overrides))
    t = cfg.training
    from omegaconf import OmegaConf

    model_yaml = run_dir / "model.yaml"
    model_yaml.write_text(OmegaConf.to_yaml(cfg.model))
    hw_args = handwritten.parse(
        [
            f"--mode={'fsdp' if int(cfg.strategy.zero_stage) >= 2 else 'ddp'}",
            f"--model={model_yaml}",
            f"--micro-batch={t.micro_batch}",
            f"--seq-len={t.seq_len}",
            f"--steps={t.steps}",
            "--broadcast-buffers=0",  # as dtlaunch's DDP
        ]
    )
    _, hw_model, hw_opt, hw_sched = handwritten.build(hw_args, torch.device("cpu"), world)
    gen = torch.Generator().manual_seed(1000 + rank)
    vocab, mb, seq = int(cfg.model.vocab_size), int(t.micro_batch), int(t.seq_len)
    tokens_per_step = mb * world * seq
    step_no = [0]
    sync = WindowSync(torch.device("cpu"), int(t.log_every), int(t.steps))

    def dt_iteration() -> None:  # the body of the Trainer's loop (checkpoint=none)
        step_no[0] += 1
        began = time.perf_counter()
        with tracker.step(step_no[0]):
            r = train_step(rt, loader, step_no[0])
            rate = tokens_per_step / (time.perf_counter() - began)
            done = sync.push(step_no[0], r.local_loss, r.grad_norm, r.applied, 0, lr=0.0, rate=rate)
        for o in done:
            metrics.log(
                o.step,
                {"loss": o.loss, "lr": 0.0, "grad_norm": o.grad_norm, "tokens_per_s": rate, "peak_mem_bytes": 0},
            )

    def hw_iteration() -> None:  # the body of bench/handwritten.py's loop, logging every step
        batch = torch.randint(0, vocab, (mb, seq + 1), generator=gen)
        loss = torch.nn.functional.cross_entropy(hw_model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        norm = handwritten.clip_grad_norm(hw_model, 1.0)
        hw_opt.step()
        hw_opt.zero_grad(set_to_none=True)
        hw_sched.step()
        json.dumps({"loss": float(loss.detach()), "grad_norm": float(norm), "t": time.time()})

    def hw_backward() -> None:  # grads to clip
        batch = torch.randint(0, vocab, (mb, seq + 1), generator=gen)
        torch.nn.functional.cross_entropy(
            hw_model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten()
        ).backward()

    # Rank 0's progress lines go where a user's would (a file here, not a terminal).
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        for _ in range(5):  # warm-up: optimizer state, the memory tracker's first steps, TensorBoard writer
            dt_iteration()
            hw_iteration()
        per_iteration = {"dtlaunch": counts(dt_iteration), "hand-written": counts(hw_iteration)}
        results: dict[str, float] = {}
        if not args.counts_only:
            # Interleave the whole iterations a few times over so drift hits both.
            dt_best, hw_best = float("inf"), float("inf")
            for _ in range(3):
                dt_best = min(dt_best, best_us(dt_iteration, args.inner, args.outer // 3 + 1))
                hw_best = min(hw_best, best_us(hw_iteration, args.inner, args.outer // 3 + 1))
            results["iteration: dtlaunch"] = dt_best
            results["iteration: hand-written"] = hw_best
            hw_backward()
            params = [list(hw_model.parameters())]
            results["data: dtlaunch TokenLoader.next_batch"] = best_us(loader.next_batch, 50, args.outer)
            results["data: torch.randint"] = best_us(
                lambda: torch.randint(0, vocab, (mb, seq + 1), generator=gen), 50, args.outer
            )
            results["clip: dtlaunch step.clip_grad_norm + float"] = best_us(
                lambda: float(clip_grad_norm(params, 1.0, None)), 50, args.outer
            )
            results["clip: torch get_total_norm + clip_grads_with_norm_ (foreach)"] = best_us(
                lambda: float(handwritten.clip_grad_norm(hw_model, 1.0)), 50, args.outer
            )
            scalar = torch.ones(())
            window = WindowSync(torch.device("cpu"), 1, 10**9)
            pushed = [0]

            def push_one() -> None:
                pushed[0] += 1
                window.push(pushed[0], scalar, scalar, True, 0)

            results["loss + flags: dtlaunch WindowSync.push (one async all-reduce per log window)"] = best_us(
                push_one, 50, args.outer
            )
            results["loss: float(loss) (hand-written)"] = best_us(lambda: float(scalar), 50, args.outer)

            def tracked() -> None:
                with tracker.step(10**6):
                    pass

            results["PeakTracker.step after its tracked steps"] = best_us(tracked, 50, args.outer)
            if rank == 0:
                n = [10**6]

                def log_once() -> None:
                    n[0] += 1
                    metrics.log(
                        n[0], {"loss": 1.0, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1.0, "peak_mem_bytes": 0}
                    )

                results["metrics: MetricsLogger.log per step (log_every=1: JSON + TensorBoard + progress line)"] = (
                    best_us(log_once, 20, args.outer, together=False)
                )
    metrics.close()
    if rank == 0:
        out = {
            "recipe": args.recipe,
            "world": world,
            "threads": torch.get_num_threads(),
            "clock": "thread CPU time" if world == 1 else "wall",
            "us": results,
            "counts per iteration": {
                side: {k: v for k, v in c.items() if k != "ops"} for side, c in per_iteration.items()
            },
        }
        if args.ops:
            out["ops per iteration"] = {
                k: [per_iteration["dtlaunch"]["ops"].get(k, 0), per_iteration["hand-written"]["ops"].get(k, 0)]
                for k in sorted(set(per_iteration["dtlaunch"]["ops"]) | set(per_iteration["hand-written"]["ops"]))
            }
        print(json.dumps(out, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
