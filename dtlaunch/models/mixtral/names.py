"""Mixtral tensor names: `block_sparse_moe.gate`, `block_sparse_moe.experts.<e>.{w1,w2,w3}`."""

from dtlaunch.models.dense.hf import rope_heads  # noqa: F401 (the names module's RoPE rows: HFWeights reads it)
from dtlaunch.models.moe.hf import MoENames

_NAMES = MoENames("block_sparse_moe", w1="w1", w2="w2", w3="w3")
to_hf_name = _NAMES.to_hf_name
from_hf_name = _NAMES.from_hf_name
expert_slot = _NAMES.expert_slot
to_hf_state = _NAMES.to_hf_state
from_hf_state = _NAMES.from_hf_state
