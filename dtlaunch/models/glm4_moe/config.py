"""GLM-4.5's own model fields: the MoE decoder's, plus partial RoPE."""

from __future__ import annotations

from dataclasses import dataclass

from dtlaunch.models.moe.config import MoeModelConfig


@dataclass
class Glm4MoeModelConfig(MoeModelConfig):
    # RoPE rotates the first head_dim x this dims of each head (Hugging Face's layout), the rest pass through.
    partial_rotary_factor: float = 0.5
