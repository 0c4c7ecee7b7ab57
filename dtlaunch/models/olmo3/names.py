"""OLMo 3's tensor names (Hugging Face <-> ours) and RoPE layout; the dense decoder's (models/dense/hf.py)
except the block norms, which OLMo applies after each sublayer, and the q/k norm gains, one per feature of
the whole projection: they are permuted like the projection's rows (per head), not once per head_dim."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.errors import InputError
from dtlaunch.models.dense import hf as dense
from dtlaunch.models.dense.shapes import kv_heads

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig

# Ours -> HF where OLMo differs: the same two modules, applied after the attention and the MLP.
_NORMS = {
    "attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_NORMS_FROM_HF = {v: k for k, v in _NORMS.items()}


def to_hf_name(name: str) -> str:
    return dense.renamed_to_hf(name, _NORMS)


def from_hf_name(name: str) -> str:
    if re.fullmatch(r"model\.layers\.\d+\.input_layernorm\.weight", name):  # a pre-norm: not OLMo's block
        raise InputError(f"unexpected tensor {name}: this architecture has no such parameter")
    return dense.renamed_from_hf(name, _NORMS_FROM_HF)


def rope_heads(name: str, m: ModelConfig) -> Optional[int]:
    if name.endswith("attention.q_norm.weight"):
        return int(m.n_heads)
    if name.endswith("attention.k_norm.weight"):
        return kv_heads(m)
    return dense.rope_heads(name, m)


def to_hf_state(state: dict, m: Any) -> dict:
    """Our parameter dict -> HF's names and RoPE layout; a tied head is written once, as the embedding."""
    return dense.to_hf_state(state, m, to_hf_name, rope_heads)


def from_hf_state(state: dict, m: Any) -> dict:
    return dense.from_hf_state(state, m, from_hf_name, rope_heads)
