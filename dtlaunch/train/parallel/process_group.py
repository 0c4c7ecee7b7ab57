"""Process group set-up and tear-down for one worker.

The group is initialised on a store prefixed with the restart count: a restarted torchrun attempt shares
the rendezvous TCPStore with the failed one, and without the prefix it reads the old attempt's gloo keys
and fails to connect or hangs (pytorch issue #135712; the prefix was measured to fix it).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Mapping, NoReturn

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    restart: int
    device: torch.device
    backend: str


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def allocator_settings(environ: Mapping[str, str]) -> str:
    """The CUDA caching allocator's settings a worker applies: expandable segments (as torchtitan's launch
    script sets), unless the user configured the allocator. Without them, blocks freed between the phases of
    a step stay reserved in fixed-size segments: on an H200 at 131,072 tokens the allocator reserved 68.5 GiB
    for a 48.1 GiB allocated peak (bench/results/gpu-2026-12-04-nvidia-h200.md), past the plan's device total."""
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF"):
        return ""
    return "expandable_segments:True"


def init_distributed(cfg: JobConfig) -> DistEnv:
    """Join the process group (torchrun env vars; a lone `python -m` run becomes a world of one)."""
    backend = cfg.launch.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=int(cfg.launch.timeout_s))
    if backend == "nccl":
        settings = allocator_settings(os.environ)
        # torch's setter (the cuda one is deprecated for the accelerator one from 2.13), before the device's
        # first allocation; the environment variable would be read too late once CUDA is initialised.
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
            torch.cuda.memory, "_set_allocator_settings", None
        )
        if settings and setter is not None:
            setter(settings)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "MASTER_ADDR" in os.environ:
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
    else:
        base = dist.HashStore()
    store = dist.PrefixStore(f"attempt_{restart_count()}", base)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    # FSDP CPU offload keeps gradients on the host: clipping's norm all-reduce runs on CPU tensors (gloo).
    group_backend = "cuda:nccl,cpu:gloo" if backend == "nccl" and cfg.strategy.cpu_offload else backend
    dist.init_process_group(group_backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistEnv(
        rank=rank, world=world, local_rank=local_rank, restart=restart_count(), device=device, backend=backend
    )


def shutdown(exit_code: int = 0) -> NoReturn:
    """Leave the job cleanly and end this worker process with `exit_code`.

    Barrier first: FSDP2 workers that tear down unsynchronised sometimes abort at exit. Even after it,
    a background C++ thread can still be joinable when the interpreter's static destructors run
    ("terminate called without an active exception", SIGABRT, seen about once in 60 gloo runs), which
    torchrun reports as a failed worker. All work is done and flushed here, so skip that teardown."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
