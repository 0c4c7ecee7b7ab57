"""DeepSeek-V3's tensor names (Hugging Face <-> ours): GLM-4.5's for the experts, router, correction bias
and shared experts (dtlaunch/models/glm4_moe/names.py), plus the latent attention's projections and norms
(ours DeepSeek's reference names, dtlaunch/models/deepseek_v3/mla.py). No row is permuted: the attention
rotates in the checkpoint's own layout (model.rope_interleave)."""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.glm4_moe import names as glm

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
    **glm._RENAMES,
    **{f"attention.{o}.{p}": f"self_attn.{t}.{p}" for o, t in _ATTENTION.items() for p in ("weight", "bias")},
}
_RENAMES_FROM_HF = {v: k for k, v in _RENAMES.items()}
hf_buffers = glm.hf_buffers
expert_slot = glm.expert_slot
skip_hf = glm.skip_hf


def to_hf_name(name: str, expert: int = 0) -> str:
    if glm._routed(name):
        return glm._MOE.to_hf_name(name, expert)
    return dense.renamed_to_hf(name, _RENAMES)


def from_hf_name(name: str) -> str:
    if glm._routed_hf(name):
        return glm._MOE.from_hf_name(name)
    return dense.renamed_from_hf(name, _RENAMES_FROM_HF)


def rope_heads(name: str, m: Any) -> Optional[int]:
    """No permutation: the rotated dims are read in the checkpoint's layout."""
    return None


def to_hf_state(state: dict, m: Any) -> dict:
    """Ours -> HF: routed experts split per expert, the rest by name."""
    out = glm._MOE.to_hf_state({n: t for n, t in state.items() if glm._routed(n)}, m)
    rest = {n: t for n, t in state.items() if not glm._routed(n)}
    out.update(dense.to_hf_state(rest, m, to_hf_name, rope_heads))
    return out


def from_hf_state(state: dict, m: Any) -> dict:
    """HF -> ours; blocks past model.n_layers (the multi-token-prediction layer) are skipped."""
    state = {n: t for n, t in state.items() if not skip_hf(n, m)}
    theirs = {n: t for n, t in state.items() if glm._routed_hf(n)}
    out = glm._MOE.from_hf_state(theirs, m)
    rest = {n: t for n, t in state.items() if n not in theirs}
    out.update(dense.from_hf_state(rest, m, from_hf_name, rope_heads))
    return out
