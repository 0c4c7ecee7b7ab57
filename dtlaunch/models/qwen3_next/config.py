"""The model fields of the Gated DeltaNet hybrid decoders: Qwen3-Next (MoE) and Qwen3.5 (dense and MoE,
dtlaunch/models/qwen3_5/). The hybrid part (the linear-attention blocks, the gated full attention with
partial RoPE, (1 + gain) norms) is one class both families share; Qwen3-Next's adds the MoE section and
the shared expert's sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtlaunch.models.dense.config import DenseModelConfig
from dtlaunch.models.moe.config import MoeModelConfig


@dataclass
class GatedDeltaNetModelConfig(DenseModelConfig):
    # One entry per block: linear_attention (Gated DeltaNet) or full_attention (gated softmax attention).
    # Empty: every fourth block attends fully, the others are linear (full_attention_interval 4).
    layer_types: list[str] = field(default_factory=list)
    # The Gated DeltaNet blocks: key heads (q and k), value heads (a multiple of them), their widths, and the
    # causal depthwise convolution over q, k and v before the delta rule.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # RoPE rotates the first head_dim x this dims of each full-attention head (Hugging Face's layout).
    partial_rotary_factor: float = 0.25
    # Every RMSNorm but the Gated DeltaNet's gated one multiplies by (norm_offset + gain), gains starting at 0.
    norm_offset: float = 1.0
    # The full attention's output times sigmoid(a per-head gate from q_proj's second half).
    attention_output_gate: bool = True


@dataclass
class Qwen3NextModelConfig(GatedDeltaNetModelConfig, MoeModelConfig):
    # The shared expert's output times sigmoid(a learned scalar per token).
    shared_expert_gate: bool = True


def layer_kinds(m) -> list[str]:
    """Each block's kind: model.layer_types, or the default (full attention every fourth block)."""
    kinds = list(getattr(m, "layer_types", None) or ())
    if kinds:
        return kinds
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(int(m.n_layers))]
