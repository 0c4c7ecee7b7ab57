"""GLM-4.5's tensor names (Hugging Face <-> ours): Qwen3-MoE's experts and gate (`mlp.experts.<e>.*`,
`mlp.gate.weight`), plus the shared experts (`mlp.shared_experts.*`, ours `feed_forward.shared_experts.*`)
and the router's correction bias (`mlp.gate.e_score_correction_bias`, ours the buffer `router.expert_bias`).

q/k rows are not permuted when RoPE is partial: the decoder then rotates in Hugging Face's layout
(dtlaunch.models.dense.model.apply_partial_rope); with partial_rotary_factor=1 it is the dense decoder's
interleaved layout and the dense permutation.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.dense.shapes import head_dim, rotary_dim
from dtlaunch.models.moe.hf import MoENames

_MOE = MoENames("mlp", w1="gate_proj", w2="down_proj", w3="up_proj")
# Ours -> HF under layers.N., where GLM-4.5 adds to the dense decoder's names.
_RENAMES = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_RENAMES_FROM_HF = {v: k for k, v in _RENAMES.items()}
# Buffers the Hugging Face directory holds and the importer loads (dtlaunch.convert.hf.HFWeights).
hf_buffers = ("router.expert_bias",)
expert_slot = _MOE.expert_slot


def _routed(name: str) -> bool:
    """A routed expert's stacked tensor or the router's gate: what Qwen3-MoE's names convert."""
    return bool(re.fullmatch(r"layers\.\d+\.feed_forward\.(experts\.w[123]|router\.gate\.weight)", name))


def _routed_hf(name: str) -> bool:
    return bool(expert_slot(name) or re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", name))


def to_hf_name(name: str, expert: int = 0) -> str:
    if _routed(name):
        return _MOE.to_hf_name(name, expert)
    return dense.renamed_to_hf(name, _RENAMES)


def from_hf_name(name: str) -> str:
    if _routed_hf(name):
        return _MOE.from_hf_name(name)
    return dense.renamed_from_hf(name, _RENAMES_FROM_HF)


def rope_heads(name: str, m: Any) -> Optional[int]:
    """The dense permutation's heads when RoPE rotates every dim; None when partial (no permutation)."""
    return dense.rope_heads(name, m) if rotary_dim(m) == head_dim(m) else None


def skip_hf(name: str, m: Any) -> bool:
    """Tensors of blocks past model.n_layers: the multi-token-prediction layer GLM-4.5 checkpoints carry
    (num_nextn_predict_layers), which transformers ignores too."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(found) and int(found.group(1)) >= int(m.n_layers)


def to_hf_state(state: dict, m: Any) -> dict:
    """Ours -> HF: routed experts split per expert, the rest by name (a tied head written once)."""
    out = _MOE.to_hf_state({n: t for n, t in state.items() if _routed(n)}, m)
    out.update(dense.to_hf_state({n: t for n, t in state.items() if not _routed(n)}, m, to_hf_name, rope_heads))
    return out


def from_hf_state(state: dict, m: Any) -> dict:
    state = {n: t for n, t in state.items() if not skip_hf(n, m)}
    theirs = {n: t for n, t in state.items() if _routed_hf(n)}
    out = _MOE.from_hf_state(theirs, m)
    rest = {n: t for n, t in state.items() if n not in theirs}
    out.update(dense.from_hf_state(rest, m, from_hf_name, rope_heads))
    return out
