"""Closed-form shapes and parameter counts of the dense decoder (pure Python: planner and validators).

One decoder covers Llama, Qwen2/2.5, Qwen3, Mistral, SmolLM3, OLMo 3 and Gemma 3; the flags of the model section
(qkv_bias, qk_norm, qk_norm_whole, sandwich_norm, tie_embeddings, head_dim) change the counts here exactly as they change the modules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


# Extra head dims of the attention-sink kernel's operands (models/dense/model.py sink_attention): one carries
# the sink, the rest pad to a multiple of 8 (SDPA's fused kernels want one).
SINK_DIMS = 8


def sink_dims(m: Any) -> int:
    """Extra head dims the attention kernel adds (gpt-oss's sinks), 0 without sinks."""
    return SINK_DIMS if getattr(m, "attention_sinks", False) else 0


def ffn_dim(m: ModelConfig) -> int:
    """SwiGLU hidden width, Meta's rule: multiple_of * ceil(int(mult * floor(8*dim/3)) / multiple_of)."""
    if m.ffn_dim:
        return int(m.ffn_dim)
    hidden = (8 * m.dim) // 3
    hidden = int(m.ffn_dim_multiplier * hidden)
    return m.multiple_of * math.ceil(hidden / m.multiple_of)


def head_dim(m: ModelConfig) -> int:
    return int(getattr(m, "head_dim", None) or m.dim // m.n_heads)


def rotary_dim(m: Any) -> int:
    """Dims of each head RoPE rotates: all of them, the first head_dim x partial_rotary_factor (GLM-4.5), or
    DeepSeek-V3's qk_rope_head_dim (its latent attention's rotated part)."""
    if getattr(m, "qk_rope_head_dim", None):
        return int(m.qk_rope_head_dim)
    return int(head_dim(m) * float(getattr(m, "partial_rotary_factor", None) or 1.0))


def kv_heads(m: ModelConfig) -> int:
    return m.n_kv_heads or m.n_heads


def tied(m: Any) -> bool:
    return bool(getattr(m, "tie_embeddings", False))


def block_norm_params(m: ModelConfig) -> int:
    """Norm gains of one block (never sharded by tensor parallel): two RMSNorms (four with Gemma's
    sandwich_norm), plus q/k norms (per head:
    head_dim gains each; over the whole projection, OLMo's qk_norm_whole: one per q and k feature)."""
    block = (4 if getattr(m, "sandwich_norm", False) else 2) * m.dim  # Gemma: a norm after each sublayer too
    if not getattr(m, "qk_norm", False):
        return block
    if getattr(m, "qk_norm_whole", False):
        return block + (m.n_heads + kv_heads(m)) * head_dim(m)
    return block + 2 * head_dim(m)


def block_params(m: ModelConfig) -> int:
    """One block: q,k,v,o projections (+ q/k/v biases, gpt-oss's o bias and sinks), SwiGLU (3 matrices), norm gains."""
    h, d = m.dim, head_dim(m)
    q, k = m.n_heads * d, kv_heads(m) * d
    attn = 2 * h * q + 2 * h * k
    if getattr(m, "qkv_bias", False):
        attn += q + 2 * k
    if getattr(m, "attention_out_bias", False):  # gpt-oss: o_proj's bias
        attn += h
    if getattr(m, "attention_sinks", False):  # gpt-oss: one sink logit per head
        attn += m.n_heads
    return attn + 3 * h * ffn_dim(m) + block_norm_params(m)


def embedding_params(m: ModelConfig) -> int:
    return m.vocab_size * m.dim


def head_params(m: ModelConfig) -> int:
    """The output head's own parameters: none when it shares the embedding matrix."""
    return 0 if tied(m) else m.vocab_size * m.dim


def param_count(m: ModelConfig) -> int:
    """P = V*h (embedding) + V*h (output head, unless tied) + h (final norm) + L * block."""
    return embedding_params(m) + head_params(m) + m.dim + m.n_layers * block_params(m)


def tp_divisors(m: ModelConfig) -> list[tuple[str, int]]:
    """(key, value) pairs a tensor-parallel degree must divide: whole heads per rank, even shards."""
    return [
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", kv_heads(m)),
        ("model.dim", m.dim),
        ("model.vocab_size", m.vocab_size),
        ("model FFN width", ffn_dim(m)),
    ]


def block_linears(m: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """The linears of one block by Hugging Face module name: (out features, in features, column-parallel
    under tensor parallel). What LoRA adapts and QLoRA quantises (the planner's fine-tuning lines)."""
    h, d = m.dim, head_dim(m)
    q, k, f = m.n_heads * d, kv_heads(m) * d, ffn_dim(m)
    return {
        "q_proj": (q, h, True),
        "k_proj": (k, h, True),
        "v_proj": (k, h, True),
        "o_proj": (h, q, False),
        "gate_proj": (f, h, True),
        "up_proj": (f, h, True),
        "down_proj": (h, f, False),
    }
