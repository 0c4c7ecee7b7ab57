"""FSDP2 CPU offload (`strategy.cpu_offload`): parameter shards, gradients and AdamW state in host memory.

torch's `CPUOffloadPolicy` keeps every FSDP unit's sharded parameters (and the gradients its
reduce-scatter produces) on the CPU: each all-gather first copies the unit's shard to the device, each
reduce-scatter's output is copied back, and the optimizer, built over the sharded parameters, steps on
the CPU. What this needs from the rest of the runtime:
- the parameters are materialised on the CPU (FSDP2 refuses offloaded parameters on the device), while
  the buffers (RoPE tables) that forward reads go to the device;
- the gradient-norm all-reduce of clipping runs on CPU tensors, so a CUDA process group also needs gloo
  (dtlaunch.train.parallel.process_group: "cuda:nccl,cpu:gloo");
- gradient accumulation keeps FSDP's reduce-scatter on every micro-step (dtlaunch.train.step.grad_sync), so the
  sharded CPU gradients are summed in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def offload_policy(cfg: JobConfig, device: torch.device) -> dict:
    """fully_shard's keyword for the job: CPU offload (pinned host memory when the device is a GPU)."""
    if not cfg.strategy.cpu_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}


def init_device(cfg: JobConfig, device: torch.device) -> torch.device:
    """Where the parameters are materialised: the host under CPU offload, else the device."""
    return torch.device("cpu") if cfg.strategy.cpu_offload else device


@torch.no_grad()
def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (computed on the host with the parameters) to the device that runs forward."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
