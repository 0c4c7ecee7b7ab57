"""Tensor parallel (Megatron-style) with optional sequence parallel, and the loss on sharded logits.

The plan is data: module name -> ParallelStyle, applied with `parallelize_module`. Names of modules a
pipeline stage does not own (tok_embeddings / norm / output set to None, deleted blocks) are skipped,
so the same plan serves a full model and any pipeline stage.

Activation layouts between blocks:
- sequence parallel: the residual stream is sharded on the sequence (Shard(1)); norms run on their
  sequence shard; attention / feed-forward inputs are all-gathered, their outputs reduce-scattered.
- without it: the residual stream is replicated; only the linear layers are split.
In both cases the logits stay sharded on the vocabulary (Shard(-1)) and the loss runs on them under
`loss_parallel()`, so no rank ever holds the full (B, S, V) logits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def model_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for the modules outside the transformer blocks (embedding, final norm, output head)."""
    # Shard(-1) logits stay a DTensor (use_local_output=False) so loss_parallel sees the layout.
    if sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles inside one TransformerBlock (names relative to the block)."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        # Replicated residual stream in, replicated out: the row-wise layers all-reduce.
        plan["attention.wo"] = RowwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel()
        return plan
    plan.update(
        {
            "attention_norm": SequenceParallel(),
            # Attention's extra positional args are the plain RoPE cos/sin buffers: None leaves them alone.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    )
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, cfg: Any) -> None:
    """Shard `model` (a full Llama or a pipeline stage of one) over `tp_mesh` in place."""
    sp = bool(cfg.strategy.sequence_parallel)
    top = {name: style for name, style in model_plan(sp).items() if getattr(model, name, None) is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sp))


def loss_context(cfg: Any, layout: Any) -> contextlib.AbstractContextManager:
    """Wrap forward *and* backward of the loss: vocabulary-sharded logits need loss_parallel for both.

    A new context per use: loss_parallel() is a one-shot generator context manager."""
    return loss_parallel() if layout.tp > 1 else contextlib.nullcontext()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of (B, S, V) logits against (B, S) targets.

    Logits are upcast to fp32 (a bf16 softmax over a large vocabulary loses precision), as in Meta's and
    torchtitan's recipes. Under TP the logits are a Shard(-1) DTensor and this must run inside
    `loss_context`; the upcast then stays sharded.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
