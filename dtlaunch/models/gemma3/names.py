"""Gemma 3's tensor names (Hugging Face <-> ours): the dense decoder's (models/dense/hf.py, RoPE layout and
per-head q/k norm gains included) except the block norms, four per block: ours attention_norm / ffn_norm
before the sublayers, post_attention_norm / post_ffn_norm on their outputs."""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.dense.hf import rope_heads  # noqa: F401 (the names module's RoPE rows: HFWeights reads it)

# Ours -> HF where Gemma differs from the dense decoder's names.
_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_NORMS_FROM_HF = {v: k for k, v in _NORMS.items()}


def to_hf_name(name: str) -> str:
    return dense.renamed_to_hf(name, _NORMS)


def from_hf_name(name: str) -> str:
    return dense.renamed_from_hf(name, _NORMS_FROM_HF)


def to_hf_state(state: dict, m: Any) -> dict:
    """Our parameter dict -> HF's names and RoPE layout; a tied head is written once, as the embedding."""
    return dense.to_hf_state(state, m, to_hf_name, rope_heads)


def from_hf_state(state: dict, m: Any) -> dict:
    return dense.from_hf_state(state, m, from_hf_name, rope_heads)
