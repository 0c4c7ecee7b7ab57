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
from dtlaunch.models.moe.hf import QwenExpertsNames

# Ours -> HF under layers.N., where GLM-4.5 adds to the dense decoder's names.
RENAMES = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
# Buffers the Hugging Face directory holds and the importer loads (dtlaunch.convert.hf.HFWeights).
hf_buffers = ("router.expert_bias",)


def rope_heads(name: str, m: Any) -> Optional[int]:
    """The dense permutation's heads when RoPE rotates every dim; None when partial (no permutation)."""
    return dense.rope_heads(name, m) if rotary_dim(m) == head_dim(m) else None


def skip_hf(name: str, m: Any) -> bool:
    """Tensors of blocks past model.n_layers: the multi-token-prediction layer GLM-4.5 checkpoints carry
    (num_nextn_predict_layers), which transformers ignores too."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(found) and int(found.group(1)) >= int(m.n_layers)


NAMES = QwenExpertsNames(RENAMES, rope_heads, skip_hf)
expert_slot, to_hf_name, from_hf_name = NAMES.expert_slot, NAMES.to_hf_name, NAMES.from_hf_name
to_hf_state, from_hf_state = NAMES.to_hf_state, NAMES.from_hf_state
