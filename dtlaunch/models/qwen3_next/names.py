"""Qwen3-Next's tensor names (Hugging Face <-> ours): Qwen3-MoE's routed experts and gate (`mlp.experts.<e>.*`,
`mlp.gate.weight`), the one shared expert (`mlp.shared_expert.*`, ours `feed_forward.shared_experts.*`) and
its gate (`mlp.shared_expert_gate`, ours `feed_forward.shared_gate`), and the Gated DeltaNet blocks'
`linear_attn.*`, ours `attention.*` under the same leaf names (dtlaunch/models/qwen3_next/gated_deltanet.py).

RoPE is partial (the first quarter of each head, in Hugging Face's layout: apply_partial_rope), so no q/k
rows are permuted; the full attention's q_proj keeps its per-head [query | gate] rows as they are.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.moe.hf import MoENames

_MOE = MoENames("mlp", w1="gate_proj", w2="down_proj", w3="up_proj")
_LINEAR_LEAVES = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight")
_LINEAR_LEAVES += ("out_proj.weight",)
# Ours -> HF under layers.N., where Qwen3-Next adds to the dense decoder's names.
_RENAMES = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
    **{f"attention.{leaf}": f"linear_attn.{leaf}" for leaf in _LINEAR_LEAVES},
}
_RENAMES_FROM_HF = {v: k for k, v in _RENAMES.items()}
expert_slot = _MOE.expert_slot


def _routed(name: str) -> bool:
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
    """No permutation: RoPE is partial and rotates in Hugging Face's layout."""
    return None


def skip_hf(name: str, m: Any) -> bool:
    """The multi-token-prediction block the published checkpoints carry (`mtp.*`), which transformers ignores too."""
    return name.startswith("mtp.")


def to_hf_state(state: dict, m: Any) -> dict:
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
