"""OLMo 3's own model fields: post-norm blocks, q/k RMSNorm over the whole projection, and which blocks
attend within `model.sliding_window` (`layer_types`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtlaunch.models.dense.config import DenseModelConfig


@dataclass
class Olmo3ModelConfig(DenseModelConfig):
    # RMSNorm on the attention and MLP outputs before each residual add, none before (OLMo 2/3).
    post_norm: bool = True
    # The q/k RMSNorm spans the whole projection (all heads) rather than each head (OLMo 2/3).
    qk_norm_whole: bool = True
    # One entry per block, "sliding_attention" (within model.sliding_window) or "full_attention"; OLMo 3
    # slides in three blocks of four. Empty: every block uses model.sliding_window (or attends fully).
    layer_types: list[str] = field(default_factory=list)
