"""The mixture-of-experts decoder's own model fields: the dense decoder's, plus the `moe` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dtlaunch.config.schema import TRAINING_CHOICE, Choice
from dtlaunch.models.dense.config import DenseModelConfig


class MoeScoreFunc(Choice):
    """How router logits become expert scores."""

    softmax = "softmax"  # Mixtral, Qwen3-MoE
    sigmoid = "sigmoid"  # DeepSeek-V3
    # Sigmoid scores plus a per-expert correction bias (`router.expert_bias`, a buffer carried by the
    # checkpoint: Hugging Face's e_score_correction_bias) added to choose experts, never to weight them:
    # DeepSeek-V3, GLM-4.5. The bias only changes in training with model.moe.bias_update_rate > 0.
    sigmoid_bias = "sigmoid_bias"


@dataclass
class MoeConfig:
    """Routed experts replacing the FFN of the sparse blocks (this folder)."""

    num_experts: int = 0
    # Experts each token is routed to (token choice; no token is ever dropped).
    top_k: int = 2
    # Width of one routed expert's SwiGLU; None = the dense FFN width (Mixtral).
    expert_dim: Optional[int] = None
    # Experts every token goes through (DeepSeek), one SwiGLU of shared_expert_dim (None: n x expert_dim).
    num_shared_experts: int = 0
    shared_expert_dim: Optional[int] = None
    score_func: MoeScoreFunc = MoeScoreFunc.softmax
    # Rescale the chosen experts' weights to sum to 1 (Mixtral; Qwen3-30B-A3B's norm_topk_prob).
    norm_topk: bool = True
    # Load-balancing loss weight (0 = off), summed over the sparse blocks' mean.
    aux_loss_coef: float = field(default=0.0, metadata=TRAINING_CHOICE)
    # DeepSeek-V3's auxiliary-loss-free balancing: per-step nudge of each expert's routing bias (0 = off).
    bias_update_rate: float = field(default=0.0, metadata=TRAINING_CHOICE)
    # Group-limited routing (DeepSeek-V3, GLM-4.5): the experts in n_group equal groups, a group scored by
    # the sum of its two best choice scores, each token choosing top_k among the topk_group best groups.
    n_group: int = 1
    topk_group: int = 1
    # The chosen experts' weights (after norm_topk) times this factor (routed_scaling_factor).
    routed_scaling: float = 1.0
    # Block i is sparse when (i + 1) % sparse_step == 0 and i is not in dense_layers (Qwen's rule).
    sparse_step: int = 1
    dense_layers: list[int] = field(default_factory=list)


@dataclass
class MoeModelConfig(DenseModelConfig):
    moe: MoeConfig = field(default_factory=MoeConfig)


def routed_experts(m: Any) -> int:
    """Routed experts per MoE layer (the registry entry's answer for this family)."""
    return int(m.moe.num_experts)
