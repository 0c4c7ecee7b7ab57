"""Qwen3.5-MoE's tensor names (Hugging Face <-> ours): Qwen3-Next's (the routed experts, router, shared expert
and its gate: dtlaunch/models/qwen3_next/names.py) with Qwen3.5's split Gated DeltaNet projections and
multimodal prefix (dtlaunch/models/qwen3_5/names.py: `model.language_model.` read as `model.`, the vision
tower and the multi-token-prediction block skipped).

Routed experts come two ways: one tensor per expert and projection (`mlp.experts.<e>.gate_proj.weight`, what
transformers' save_pretrained writes, and what export writes), or fused per layer as Qwen's published
checkpoints hold them and transformers' Qwen3_5MoeExperts does: `mlp.experts.gate_up_proj` [E, 2F, dim]
(gate rows, then up rows) and `mlp.experts.down_proj` [E, dim, F], read as ours by `hf_parts`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from dtlaunch.models.moe.hf import QwenExpertsNames
from dtlaunch.models.qwen3_5.names import rope_heads, skip_hf, text_name
from dtlaunch.models.qwen3_next.names import SHARED_EXPERT, SPLIT, linear_renames

NAMES = QwenExpertsNames({**SHARED_EXPERT, **linear_renames(SPLIT)}, rope_heads, skip_hf)
_FUSED = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
to_hf_name, to_hf_state = NAMES.to_hf_name, NAMES.to_hf_state


def expert_slot(hf_name: str) -> Optional[tuple[str, int]]:
    return NAMES.expert_slot(text_name(hf_name))


def from_hf_name(hf_name: str) -> str:
    return NAMES.from_hf_name(text_name(hf_name))


def _gate(t: Any) -> Any:
    return t[:, : t.shape[1] // 2]


def _up(t: Any) -> Any:
    return t[:, t.shape[1] // 2 :]


def _same(t: Any) -> Any:
    return t


def hf_parts(hf_name: str) -> Optional[dict[str, Callable[[Any], Any]]]:
    """Our expert stacks in a fused HF expert tensor (or a block of its leading expert rows), each with the
    function taking it to ours (already [E, out, in]: a slice, no transpose); None for other tensors."""
    hit = _FUSED.fullmatch(hf_name)
    if not hit:
        return None
    ours = f"layers.{hit.group(1)}.feed_forward.experts"
    return {f"{ours}.w1": _gate, f"{ours}.w3": _up} if hit.group(2) == "gate_up_proj" else {f"{ours}.w2": _same}


def from_hf_state(state: dict, m: Any) -> dict:
    out, rest = {}, {}
    for hf_name, t in state.items():
        parts = hf_parts(hf_name)
        if parts is None:
            rest[text_name(hf_name)] = t
        else:
            out.update({ours: take(t).contiguous() for ours, take in parts.items()})
    out.update(NAMES.from_hf_state(rest, m))
    return out
