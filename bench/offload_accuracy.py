"""Planner accuracy under offloading, on 2-process (and 1-process) CPU gloo runs: planned vs measured device and
host bytes.

  python bench/offload_accuracy.py          # writes bench/results/offload-accuracy-cpu.{md,json}

On CPU, "host" and "device" are the same memory, so nothing really moves. What is measured instead, per
rank over the third step of the runtime's own build and `train_step` (forked gloo workers):
- host: the bytes that would live on the host: the activation-offload hooks' held bytes
  (`ActivationOffloader.held_bytes`), plus under `strategy.cpu_offload` the storage of the FSDP parameter
  shards, their gradients and the AdamW state (FSDP2's CPUOffloadPolicy keeps exactly these on the host);
  its peak is compared with the plan's host lines per rank;
- device: the tensor-storage tracker's live bytes (dtlaunch.train.observe.memtrack.StorageCounter) minus
  those host bytes, at every op; its peak is compared with the plan's peak allocated bytes.
What CPU cannot show: the transfer time, pinned-memory allocation, the side stream, and FSDP's per-unit
copy of a shard to the device before its all-gather (a no-op `.to` on CPU). The plan counts that copy, as
a GPU makes it; the "copy-in" column says how much of the planned device peak it is (on one rank a whole
block's fp32 parameters, as planned; FSDP2 copies them one parameter at a time there).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
import tempfile
from pathlib import Path

BASE = ["model=planner7m", "training.micro_batch=4", "training.seq_len=128", "hardware=cpu"]
N2 = "launch.nproc_per_node=2"
RUNS = [
    ["strategy=zero3", N2, "training.activation_offload=true"],
    ["strategy=zero3", N2, "training.activation_offload=true", "training.activation_checkpointing=full"],
    ["strategy=zero3", N2, "training.activation_offload=true", "training.activation_checkpointing=selective"],
    ["strategy=zero3", N2, "training.activation_offload=true", "precision=bf16"],
    ["strategy=tp", N2, "training.activation_offload=true"],
    ["strategy=zero3", N2, "strategy.cpu_offload=true"],
    ["strategy=zero2", N2, "strategy.cpu_offload=true", "precision=bf16"],
    ["strategy=zero3", N2, "strategy.cpu_offload=true", "training.activation_offload=true", "training.global_batch=16"],
]
# CPU offload on one rank (FSDP over a 1-rank mesh only to keep the state on the host: ZeRO-Offload on one GPU).
N1 = "launch.nproc_per_node=1"
ONE_RANK_RUNS = [
    ["strategy=zero3", N1, "strategy.cpu_offload=true"],
    ["strategy=zero3", N1, "strategy.cpu_offload=true", "precision=bf16", "training.activation_checkpointing=full"],
]
STEPS = 3


def _measure(overrides: list[str]) -> dict:
    """One run on this (forked) rank: the plan, and the measured device / host peaks of step 3."""
    from unittest import mock

    import torch
    import torch.distributed as dist

    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate
    from dtlaunch.plan import offload
    from dtlaunch.plan.memory import plan_memory
    from dtlaunch.train.batch import MicroBatch
    from dtlaunch.train.observe.memtrack import StorageCounter, state_tensors
    from dtlaunch.train.parallel.mesh import dp_rank_size
    from dtlaunch.train.parallel.process_group import DistEnv
    from dtlaunch.train.runtime import build_runtime
    from dtlaunch.train.step import train_step

    cfg = compose([*BASE, *overrides]).cfg
    layout = validate(cfg).layout
    plan = plan_memory(cfg, layout)
    with mock.patch.object(offload, "staging_bytes", lambda c: 0.0):
        cpu_plan = plan_memory(cfg, layout)  # the same without the shard's copy to the device
    env = DistEnv(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=0,
        restart=0,
        device=torch.device("cpu"),
        backend="gloo",
    )
    torch.manual_seed(0)
    rt = build_runtime(cfg, env)
    dp_rank, dp_size = dp_rank_size(rt.mesh)
    model = rt.model_parts[0]
    off = getattr(getattr(model, "module", model), "activation_offloader", None)
    params = [p for part in rt.model_parts for p in part.parameters()]

    class Batches:
        gen = torch.Generator().manual_seed(dp_rank)

        def next_batch(self) -> MicroBatch:
            t = torch.randint(0, int(cfg.model.vocab_size), (int(cfg.training.micro_batch), 129), generator=self.gen)
            return MicroBatch(t[:, :-1], t[:, 1:])

    def nbytes(ts) -> int:
        seen, total = set(), 0
        for t in ts:
            local = t.to_local() if hasattr(t, "to_local") else t
            st = local.untyped_storage()
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total

    def host_states() -> int:
        if not cfg.strategy.cpu_offload:
            return 0
        opt = [v for o in rt.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
        return nbytes([*params, *(p.grad for p in params if p.grad is not None), *opt])

    class Split(StorageCounter):
        device_peak = 0
        host_peak = 0
        step_base = -1  # live bytes when the optimizer step began (-1: not in it)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            host = host_states() + (off.held_bytes if off is not None else 0)
            if self.step_base >= 0 and cfg.strategy.cpu_offload:
                # The CPU optimizer's own allocations (foreach AdamW's temporaries) are on the host too.
                host += max(0, self.live - self.step_base)
            self.device_peak = max(self.device_peak, self.live - host)
            self.host_peak = max(self.host_peak, host)
            return out

    batches = Batches()
    for step in range(1, STEPS):
        train_step(rt, batches, step)
    counter = Split()
    for opt in rt.optimizers:
        opt.register_step_pre_hook(lambda *_: setattr(counter, "step_base", counter.live))
        opt.register_step_post_hook(lambda *_: setattr(counter, "step_base", -1))
    counter.add_existing(state_tensors(rt.model_parts, rt.optimizers))
    with counter:
        train_step(rt, batches, STEPS)
    return {
        "name": " ".join(overrides),
        "planned_device": plan.peak,
        "copy_in": plan.peak - cpu_plan.peak,
        "planned_host": plan.host_per_rank,
        "planned_host_lines": {k: int(v) for k, v in plan.worst_host.items()},
        "device": counter.device_peak,
        "host": counter.host_peak,
        "total": counter.peak,
        "packed_per_step": off.packed_bytes if off is not None else 0,
        "dp": [dp_rank, dp_size],
    }


def _worker(rank: int, world: int, port: int, out: str, runs: list[list[str]]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = [_measure(ov) for ov in runs]
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run(runs: list[list[str]] = RUNS, world: int = 2) -> list[dict]:
    """Every run of `runs` on `world` forked gloo workers; the most loaded rank's figures per run."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows")
        mp.start_processes(_worker, args=(world, port, out, runs), nprocs=world, start_method="fork")
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    rows = []
    for ranks in zip(*per_rank, strict=True):
        row = dict(ranks[0])
        for k in ("device", "host", "total", "packed_per_step"):
            row[k] = max(r[k] for r in ranks)  # the most loaded rank, as the plan's figures are
        rows.append(row)
    return rows


def _err(planned: float, measured: float) -> str:
    return f"{(planned - measured) / measured * 100:+.1f} %" if measured else "-"


def write(rows: list[dict], results: Path) -> Path:
    mib = 2**20
    lines = [
        f"# Offload planner accuracy on CPU ({datetime.date.today()}, {platform.machine()}, torch CPU build, 2 gloo ranks; 1 where the overrides say so)",
        "",
        f"`python bench/offload_accuracy.py`; base: {' '.join(BASE)}; step {STEPS}, most loaded rank.",
        "Host = bytes the offload would keep on the host (hooks' held activations; FSDP shards, gradients, AdamW",
        "state under cpu_offload); device = storage-tracker live bytes minus those. On CPU nothing moves: see the",
        "module docstring for what this can and cannot show.",
        "",
        "| overrides | planned device MiB | measured device MiB | error | copy-in MiB | planned host MiB | measured host MiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['planned_device'] / mib:.2f} | {r['device'] / mib:.2f} | "
            f"{_err(r['planned_device'], r['device'])} | {r['copy_in'] / mib:.2f} | {r['planned_host'] / mib:.2f} | "
            f"{r['host'] / mib:.2f} | {_err(r['planned_host'], r['host'])} |"
        )
    md = results / "offload-accuracy-cpu.md"
    md.write_text("\n".join(lines) + "\n")
    (results / "offload-accuracy-cpu.json").write_text(json.dumps(rows, indent=1))
    return md


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rows = run() + run(ONE_RANK_RUNS, world=1)
    for r in rows:
        print(
            f"{r['name']:90s} device {r['planned_device'] / 2**20:7.2f}/{r['device'] / 2**20:7.2f} MiB "
            f"({_err(r['planned_device'], r['device'])})  host {r['planned_host'] / 2**20:7.2f}/"
            f"{r['host'] / 2**20:7.2f} MiB ({_err(r['planned_host'], r['host'])})"
        )
    print(write(rows, Path(__file__).resolve().parent / "results"))
