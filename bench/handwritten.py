"""The reference: a hand-written PyTorch training loop, as the tutorials write it.

Same Llama module, micro-batch, sequence length, optimizer (AdamW, no decay on norm gains, warmup +
cosine schedule, grad clipping), dtype and data-parallel wrapper (DDP or per-block FSDP2) as the
dtlaunch job it is compared with, but none of dtlaunch's machinery: torchrun env, init_process_group,
a plain loop over synthetic tokens. The benchmark harness (bench/throughput.py) derives every setting
from the composed dtlaunch config, so the two cannot drift apart.

Rank 0 writes one JSON line per logged step to stdout and, with --metrics-file, to that file (the
harness watches it to time the first step): {"step", "loss", "grad_norm", "elapsed_s", "time"}.
Like dtlaunch's logger, it turns losses into numbers only every --log-every steps, so on a GPU the
loop syncs once per logging window, not per step.

    torchrun --standalone --nproc-per-node 2 bench/handwritten.py --mode fsdp --model small
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--model", default="small", help="a configs/model option, or a path to a model YAML")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1, help="FSDP2 only (ZeRO-3 = 1)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument(
        "--broadcast-buffers", type=int, choices=(0, 1), default=1, help="DDP only: re-broadcast buffers every forward"
    )
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--metrics-file", default="", help="also append rank 0's JSON lines here")
    return p.parse_args(argv)


def model_config(name: str):  # noqa: ANN201 - an OmegaConf node
    """The model section from its YAML, merged onto the schema's defaults (no dtlaunch composition)."""
    from omegaconf import OmegaConf

    from dtlaunch.job.model_schema import typed_model

    path = Path(name) if name.endswith((".yaml", ".yml")) else ROOT / "configs" / "model" / f"{name}.yaml"
    return typed_model(OmegaConf.load(path))


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build(args: argparse.Namespace, device: torch.device, world: int):  # noqa: ANN201 - (cfg, model, opt, sched)
    """The model (wrapped in DDP / FSDP2 when there is more than one rank), AdamW and its schedule."""
    from dtlaunch.models.dense.model import Llama

    cfg = model_config(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg, rope_len=args.seq_len)
    if args.compile:
        for block in model.layers.values():
            block.compile()
    low = torch.bfloat16 if args.dtype == "bf16" else None
    if world == 1:
        pass  # one rank: nothing to synchronise, so no wrapper (dtlaunch does the same)
    elif args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from dtlaunch.train.parallel.parallelize import no_buffer_sync

        ids = [device.index] if device.type == "cuda" else None
        sync = {} if args.broadcast_buffers else no_buffer_sync()
        model = DistributedDataParallel(model, device_ids=ids, **sync)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"reshard_after_forward": bool(args.reshard_after_forward)}
        if low is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        **fast,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, args.steps, args.min_lr_ratio))
    return cfg, model, opt, sched


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clipping; under FSDP2 the norm of sharded grads is a partial DTensor, reduced first."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach=True)
    return norm


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.time()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    cfg, model, opt, sched = build(args, device, world)
    # DDP (and a single process) computes in bf16 under autocast; FSDP2 casts through its policy.
    autocast = args.dtype == "bf16" and (args.mode == "ddp" or world == 1)
    out = open(args.metrics_file, "a", buffering=1) if args.metrics_file and rank == 0 else None  # noqa: SIM115

    gen = torch.Generator().manual_seed(1000 + rank)
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        norm = clip_grad_norm(model, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        pending.append((step, loss.detach(), norm.detach()))
        if step % args.log_every == 0 or step == args.steps:
            # One host sync per logging window (the first .item() waits; the rest are ready).
            rows = [(s, float(lo), float(n)) for s, lo, n in pending]
            pending.clear()
            elapsed = time.perf_counter() - t0
            if rank == 0:
                for s, lo, n in rows:
                    line = json.dumps(
                        {"step": s, "loss": lo, "grad_norm": n, "elapsed_s": round(elapsed, 4), "time": time.time()}
                    )
                    print(line, flush=True)
                    if out is not None:
                        out.write(line + "\n")
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    peaks = [0] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        print(json.dumps({"summary": True, "start": start, "world": world, "peak_mem_bytes_per_rank": peaks}))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
