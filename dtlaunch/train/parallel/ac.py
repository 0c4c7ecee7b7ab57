"""Activation checkpointing of a model's blocks (`training.activation_checkpointing`).

- full: every block keeps only its input and is recomputed whole in backward.
- selective, ac_policy=op: inside each block, save the outputs of attention and of every other
  matmul (the 1st, 3rd, ... of the block: wq, wv, w1, w2; an MoE experts' grouped GEMM counts as one),
  recompute the rest (the other matmuls and
  everything elementwise: norms, RoPE, SiLU). Recomputing half the matmuls frees their outputs (the
  F-wide w3 output among them) for about a sixth more block compute; elementwise ops cost little.
- selective, ac_policy=layer: checkpoint (fully) every `ac_every_n_layers`-th block (the n-th, 2n-th,
  ... by global block index, so pipeline stages agree with the whole model), keep the others.
- selective with ac_memory_budget > 0 (compile only, validated): no wrappers; torch.compile's
  min-cut partitioner keeps that fraction of the compiled graph's saved activations and recomputes
  the cheapest rest.

The planner (dtlaunch.models.dense.activations) models each mode from the same rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from dtlaunch.config.schema import TrainingConfig


def apply_ac(model: nn.Module, t: TrainingConfig) -> None:
    """Wrap `model.layers`' blocks for `t` (the training section)."""
    mode = t.activation_checkpointing
    if mode == "none":
        return
    if mode == "selective" and float(t.ac_memory_budget) > 0:
        set_memory_budget(float(t.ac_memory_budget))
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    every = 1
    if mode == "selective" and t.ac_policy == "layer":
        every = int(t.ac_every_n_layers)
    elif mode == "selective":
        kwargs["context_fn"] = op_policy_context
    for name, block in list(model.layers.items()):
        if checkpointed_layer(int(name), every):
            model.layers[name] = checkpoint_wrapper(block, **kwargs)


def checkpointed_layer(index: int, every: int) -> bool:
    """Layer-level policy: the every-th, 2·every-th, ... block (global 0-based index) is checkpointed."""
    return (index + 1) % every == 0


def set_memory_budget(budget: float) -> None:
    """torch.compile's partitioner keeps `budget` of its default saved activations (process-wide)."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget


def _always_saved() -> set:
    """Attention kernels (every backend) and the reduce-scatter of sequence-parallel outputs."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


_SAVED: Optional[set] = None
_MATMULS: Optional[set] = None


def op_policy_context() -> Any:
    """Fresh forward/recompute contexts for one checkpointed call (a block's forward). Matmuls are
    counted separately in forward and in recompute, so both agree on which ones are saved."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy({"forward": 0, "recompute": 0}))


def _op_policy(counts: dict[str, int]) -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    global _SAVED, _MATMULS
    if _SAVED is None or _MATMULS is None:
        _SAVED = _always_saved()
        # The MoE experts' grouped GEMM (all experts in one call) counts as one matmul: the alternation
        # then recomputes the gate and down projections and keeps the up one, as the per-expert loop
        # keeps about every other one (torchtitan's op list saves no grouped GEMM, recomputing every
        # expert matmul: the experts are most of an MoE block's FLOPs).
        _MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
        if hasattr(torch.ops.aten, "_grouped_mm"):
            _MATMULS.add(torch.ops.aten._grouped_mm.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in _MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy
