"""Tensor-parallel plan of the deepseek_v3 decoder: the MoE decoder's (embedding, head, norms, routed and
shared experts, sequence parallel's gathers) with the latent attention split by heads, as torchtitan splits
it: the per-head projections wq (or wq_b after the low-rank query) and wkv_b column-parallel, wo
row-parallel; wq_a, wkv_a and the q / kv latent norms whole on every rank (they are low-rank). The rotated
key every head shares comes whole out of wkv_a: its gradient is summed over the ranks (`shared_key`, mla.py).
Heads must divide by tp (check.py)."""

from __future__ import annotations

from typing import Any

from dtlaunch.models.moe import tp_plan as moe
from dtlaunch.models.tp_styles import Colwise, Rowwise, Style, SumGrad


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    return moe.model_plan(m, sequence_parallel)


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    # The dense attention's linears out; "attention" (sequence parallel's gather of its input) stays.
    plan = {k: v for k, v in moe.block_plan(m, sequence_parallel).items() if not k.startswith("attention.")}
    plan["attention.wq_b" if m.q_lora_rank else "attention.wq"] = Colwise()
    plan["attention.wkv_b"] = Colwise()
    plan["attention.shared_key"] = SumGrad()
    plan["attention.wo"] = Rowwise(output="shard(1)" if sequence_parallel else "replicate")
    return plan
