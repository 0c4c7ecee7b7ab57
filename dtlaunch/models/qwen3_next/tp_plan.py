"""Tensor-parallel plan of the Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe): the MoE decoder's
plan (or, without a model.moe section, the dense decoder's) for the embedding, head, FFNs and the gated full
attention (its q projection holds each head's query and gate rows together, so head shards keep them
together), and the linear blocks split by key heads: each rank takes tp-th of the key heads and the value
heads they serve.

- Qwen3-Next's fused in_proj_qkvz / in_proj_ba are laid out per key head ([q | k | v | z] and [b | a] of
  each key head's group), so a plain column split gives a rank whole groups; Qwen3.5's in_proj_z / b / a
  run head after head (value head h reads key head h // (n_v / n_k)), so a column split does too.
- Qwen3.5's in_proj_qkv and the depthwise conv1d hold [all q | all k | all v]: a rank's heads are three
  slices, not one, which no DTensor placement expresses (`WholeWeights`). Their weights are stored as a
  plain row split of the one-process layout (checkpoints and the Hugging Face export hold them as one
  process does), gathered whole for each forward and cut to the rank's slice of each part; the gradient
  is reduce-scattered back to the row shards.
- A_log and dt_bias (one entry per value head) shard with the heads (the module's `head_parameters`); the
  gated norm's gain (head_v_dim, shared by every head) stays whole, its gradient summed; out_proj is
  row-parallel.
The module counts its heads from what its projections return. Under sequence parallel the block's input is
gathered (the decoder's "attention" entry: it needs the whole sequence) and out_proj's output
reduce-scattered, as for attention. tp must divide the key heads (shapes.tp_divisors).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import tp_plan as dense
from dtlaunch.models.moe import tp_plan as moe
from dtlaunch.models.qwen3_next.shapes import linear_widths
from dtlaunch.models.tp_styles import Colwise, Rowwise, Style, WholeWeights


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    return dense.model_plan(m, sequence_parallel)


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    base = moe if getattr(m, "moe", None) is not None else dense
    plan = dict(base.block_plan(m, sequence_parallel))
    key, value, _ = linear_widths(m)
    qkv = (key, key, value)
    for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a"):
        plan[f"attention.{name}"] = Colwise()
    plan["attention.in_proj_qkv"] = WholeWeights(parts=qkv, whole_input=True)
    plan["attention.conv1d"] = WholeWeights(parts=qkv)
    plan["attention.norm"] = WholeWeights()
    plan["attention.out_proj"] = Rowwise(output="shard(1)" if sequence_parallel else "replicate")
    return plan
