"""Qwen3-Next's tensor names (Hugging Face <-> ours): Qwen3-MoE's routed experts and gate (`mlp.experts.<e>.*`,
`mlp.gate.weight`), the one shared expert (`mlp.shared_expert.*`, ours `feed_forward.shared_experts.*`) and
its gate (`mlp.shared_expert_gate`, ours `feed_forward.shared_gate`), and the Gated DeltaNet blocks'
`linear_attn.*`, ours `attention.*` under the same leaf names (dtlaunch/models/qwen3_next/gated_deltanet.py).

RoPE is partial (the first quarter of each head, in Hugging Face's layout: apply_partial_rope), so no q/k
rows are permuted; the full attention's q_proj keeps its per-head [query | gate] rows as they are.
"""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.models.moe.hf import QwenExpertsNames

FUSED = ("in_proj_qkvz.weight", "in_proj_ba.weight")
SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # Qwen3.5's


def linear_renames(projections: tuple[str, ...]) -> dict[str, str]:
    """Ours -> HF under layers.N. of a Gated DeltaNet block with these input projections (FUSED or SPLIT)."""
    leaves = (*projections, "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
    return {f"attention.{leaf}": f"linear_attn.{leaf}" for leaf in leaves}


# Ours -> HF under layers.N., where the MoE hybrids (Qwen3-Next, Qwen3.5-MoE) add to the dense decoder's names.
SHARED_EXPERT = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
_RENAMES = {**SHARED_EXPERT, **linear_renames(FUSED)}


def rope_heads(name: str, m: Any) -> Optional[int]:
    """No permutation: RoPE is partial and rotates in Hugging Face's layout."""
    return None


def skip_hf(name: str, m: Any) -> bool:
    """The multi-token-prediction block the published checkpoints carry (`mtp.*`), which transformers ignores too."""
    return name.startswith("mtp.")


NAMES = QwenExpertsNames(_RENAMES, rope_heads, skip_hf)
expert_slot, to_hf_name, from_hf_name = NAMES.expert_slot, NAMES.to_hf_name, NAMES.from_hf_name
to_hf_state, from_hf_state = NAMES.to_hf_state, NAMES.from_hf_state
