"""Hardware-profile helpers: capacity, peak throughput and link bandwidths in SI units."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtlaunch.config.schema import HardwareConfig

GIB = 1024**3
# gloo's all-gather and reduce-scatter (a CPU profile) copy their whole buffer this many times more than
# NCCL's (real gloo runs: LoRA ZeRO-3's frozen embedding gather, the root and head units' reduce-scatter).
# Not measured by a test: the trace's emulated process group copies nothing, only real gloo runs show it
# (bench/planner_accuracy.py --real).
GLOO_EXTRA_BUFFER_COPIES = 1


def capacity_bytes(hw: HardwareConfig) -> float:
    return float(hw.memory_gib) * GIB


def peak_flops(hw: HardwareConfig, dtype: str) -> float:
    """Dense peak FLOP/s for the compute dtype; a CPU profile without numbers gets a nominal 1 TFLOP/s
    so that the search can still rank layouts."""
    tf = hw.peak_tflops_bf16 if dtype in ("bf16", "fp16") else hw.peak_tflops_fp32
    return (tf or hw.peak_tflops_bf16 or 1.0) * 1e12


def link_bandwidth(hw: HardwareConfig, group_size: int, contiguous_ranks: int) -> float:
    """Bytes/s per device for a collective over `group_size` ranks spaced `contiguous_ranks` apart:
    inside a node it runs on NVLink, otherwise the inter-node link is the bottleneck."""
    per_node = int(hw.gpus_per_node) or 1
    intra = (hw.intra_node_gbps or 100.0) * 1e9
    inter = (hw.inter_node_gbps or hw.intra_node_gbps or 10.0) * 1e9
    return intra if group_size * contiguous_ranks <= per_node else inter


def gloo_collectives(hw: HardwareConfig) -> bool:
    """Whether a run on this profile communicates over gloo (the CPU profile), whose all-gather and
    reduce-scatter copy their whole buffer once more; NCCL's do not."""
    return not int(hw.gpus_per_node)  # GLOO_EXTRA_BUFFER_COPIES
