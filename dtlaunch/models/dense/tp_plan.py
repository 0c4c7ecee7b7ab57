"""Tensor-parallel plan of the dense decoder: data, module name -> ParallelStyle.

Megatron-style: q/k/v and w1/w3 column-parallel (their biases shard with their rows, whole heads per
rank), wo and w2 row-parallel. Per-head q/k norms act on head-sharded activations with a weight of
head_dim entries shared by every head: `SequenceParallel(sequence_dim=2)` keeps that weight
replicated and sums its gradient over the tensor-parallel ranks (each rank saw only its heads).
Sequence parallel (SP) additionally shards the residual stream and the block norms on the sequence.
The embedding and head styles (vocabulary-parallel embedding, vocabulary-sharded logits) come from
`dtlaunch.train.parallel.tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for the modules outside the blocks (embedding, final norm, output head)."""
    from dtlaunch.train.parallel.tensor_parallel import VocabParallel

    # Shard(-1) logits stay a DTensor (use_local_output=False) so loss_parallel sees the layout.
    if sequence_parallel:
        return {
            "tok_embeddings": VocabParallel(output_layout=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
    return {
        "tok_embeddings": VocabParallel(output_layout=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles inside one block (names relative to the block)."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if getattr(m, "qk_norm", False):
        # Input (B, S, heads on this rank, head_dim): sharded on dim 2; output back to a local tensor.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        # Replicated residual stream in, replicated out: the row-wise layers all-reduce.
        plan["attention.wo"] = RowwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel()
        return plan
    plan.update(
        {
            "attention_norm": SequenceParallel(),
            # Attention's extra positional args are the plain RoPE cos/sin tables and the document mask (or
            # None): None leaves them alone.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
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
