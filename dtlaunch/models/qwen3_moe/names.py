"""Qwen3-MoE tensor names: `mlp.gate`, `mlp.experts.<e>.{gate,up,down}_proj`."""

from dtlaunch.models.dense.hf import rope_heads  # noqa: F401 (the names module's RoPE rows: HFWeights reads it)
from dtlaunch.models.moe.hf import MoENames

_NAMES = MoENames("mlp", w1="gate_proj", w2="down_proj", w3="up_proj")
to_hf_name = _NAMES.to_hf_name
from_hf_name = _NAMES.from_hf_name
expert_slot = _NAMES.expert_slot
to_hf_state = _NAMES.to_hf_state
from_hf_state = _NAMES.from_hf_state
