"""DeepSeek-V3's tensor names (Hugging Face <-> ours): GLM-4.5's for the experts, router, correction bias
and shared experts (dtlaunch/models/glm4_moe/names.py), plus the latent attention's projections and norms
(ours DeepSeek's reference names, dtlaunch/models/deepseek_v3/mla.py). No row is permuted: the attention
rotates in the checkpoint's own layout (model.rope_interleave)."""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.models.glm4_moe import names as glm
from dtlaunch.models.moe.hf import QwenExpertsNames

_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
# Ours -> HF under layers.N.
_RENAMES = {
    **glm.RENAMES,
    **{f"attention.{o}.{p}": f"self_attn.{t}.{p}" for o, t in _ATTENTION.items() for p in ("weight", "bias")},
}
hf_buffers = glm.hf_buffers
skip_hf = glm.skip_hf


def rope_heads(name: str, m: Any) -> Optional[int]:
    """No permutation: the rotated dims are read in the checkpoint's layout."""
    return None


NAMES = QwenExpertsNames(_RENAMES, rope_heads, skip_hf)
expert_slot, to_hf_name, from_hf_name = NAMES.expert_slot, NAMES.to_hf_name, NAMES.from_hf_name
to_hf_state, from_hf_state = NAMES.to_hf_state, NAMES.from_hf_state
