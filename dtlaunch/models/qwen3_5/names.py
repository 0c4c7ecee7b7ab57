"""Qwen3.5's tensor names (Hugging Face <-> ours): the dense decoder's (no q/k rows permuted: RoPE is partial,
in Hugging Face's layout) and the Gated DeltaNet blocks' `linear_attn.*` with Qwen3.5's split input
projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), ours `attention.*` under the same leaves.

A Qwen3_5ForConditionalGeneration checkpoint holds the text decoder under `model.language_model.` (read as
under `model.`), its vision tower under `model.visual.` and, published, a multi-token-prediction block under
`mtp.`: both skipped, as transformers' Qwen3_5ForCausalLM skips them. Export writes Qwen3_5ForCausalLM's
names (`model.*`, `lm_head.weight`). qwen3_5_moe's names (dtlaunch/models/qwen3_5_moe/names.py) use these
helpers.
"""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.qwen3_next.names import SPLIT, linear_renames

TEXT = "model.language_model."
SKIPPED = ("model.visual.", "mtp.")


def text_name(hf_name: str) -> str:
    """A multimodal checkpoint's text-decoder name as Qwen3_5ForCausalLM's; other names as they are."""
    return "model." + hf_name[len(TEXT) :] if hf_name.startswith(TEXT) else hf_name


def skip_hf(name: str, m: Any) -> bool:
    """The vision tower and the multi-token-prediction block: no part of the text decoder."""
    return name.startswith(SKIPPED)


def rope_heads(name: str, m: Any) -> Optional[int]:
    """No permutation: RoPE is partial and rotates in Hugging Face's layout."""
    return None


_RENAMES = linear_renames(SPLIT)
_FROM_HF = {v: k for k, v in _RENAMES.items()}


def to_hf_name(name: str) -> str:
    return dense.renamed_to_hf(name, _RENAMES)


def from_hf_name(name: str) -> str:
    return dense.renamed_from_hf(text_name(name), _FROM_HF)


def to_hf_state(state: dict, m: Any) -> dict:
    return dense.to_hf_state(state, m, to_hf_name, rope_heads)


def from_hf_state(state: dict, m: Any) -> dict:
    kept = {text_name(n): t for n, t in state.items() if not skip_hf(n, m)}
    return dense.from_hf_state(kept, m, from_hf_name, rope_heads)
