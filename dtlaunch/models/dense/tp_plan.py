"""Tensor-parallel plan of the dense decoder: data, module name -> style (dtlaunch.models.tp_styles).

Megatron-style: q/k/v and w1/w3 column-parallel (their biases shard with their rows, whole heads per
rank), wo and w2 row-parallel. Per-head q/k norms act on head-sharded activations with a weight of
head_dim entries shared by every head: `SequenceParallel(sequence_dim=2)` keeps that weight
replicated and sums its gradient over the tensor-parallel ranks (each rank saw only its heads).
Sequence parallel (SP) additionally shards the residual stream and the block norms on the sequence.
The embedding is vocabulary-parallel and the logits stay sharded on the vocabulary (a DTensor for the
loss under loss_parallel).
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.tp_styles import Colwise, PrepareInput, Rowwise, SequenceShard, Style, VocabEmbedding


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    """Styles for the modules outside the blocks (embedding, final norm, output head)."""
    # Shard(-1) logits stay a DTensor (use_local_output=False) so loss_parallel sees the layout.
    if sequence_parallel:
        return {
            "tok_embeddings": VocabEmbedding(output="shard(1)"),
            "norm": SequenceShard(),
            "output": Colwise(input="shard(1)", output="shard(-1)", local_output=False),
        }
    return {
        "tok_embeddings": VocabEmbedding(output="replicate"),
        "output": Colwise(input="replicate", output="shard(-1)", local_output=False),
    }


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    """Styles inside one block (names relative to the block)."""
    plan: dict[str, Style] = {
        "attention.wq": Colwise(),
        "attention.wk": Colwise(),
        "attention.wv": Colwise(),
        "feed_forward.w1": Colwise(),
        "feed_forward.w3": Colwise(),
    }
    if getattr(m, "qk_norm", False):
        # Input (B, S, heads on this rank, head_dim): sharded on dim 2; output back to a local tensor.
        plan["attention.q_norm"] = SequenceShard(dim=2, local_output=True)
        plan["attention.k_norm"] = SequenceShard(dim=2, local_output=True)
    if not sequence_parallel:
        # Replicated residual stream in, replicated out: the row-wise layers all-reduce.
        plan["attention.wo"] = Rowwise()
        plan["feed_forward.w2"] = Rowwise()
        return plan
    plan.update(
        {
            "attention_norm": SequenceShard(),
            # Attention's extra positional args are the plain RoPE cos/sin tables and the document mask (or
            # None): None leaves them alone.
            "attention": PrepareInput(
                inputs=("shard(1)", None, None, None), desired=("replicate", None, None, None), local_output=True
            ),
            "attention.wo": Rowwise(output="shard(1)"),
            "ffn_norm": SequenceShard(),
            "feed_forward": PrepareInput(inputs=("shard(1)",), desired=("replicate",), local_output=True),
            "feed_forward.w2": Rowwise(output="shard(1)"),
        }
    )
    if getattr(m, "sandwich_norm", False):
        # Gemma's norms on the sublayer outputs: on the row-parallel layers' sequence shards, their result
        # added to the (local) residual shard.
        plan["post_attention_norm"] = SequenceShard(local_output=True)
        plan["post_ffn_norm"] = SequenceShard(local_output=True)
    return plan
