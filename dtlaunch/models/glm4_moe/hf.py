"""GLM-4.5's config.json (Glm4MoeConfig) <-> the model section: the dense keys, partial RoPE in
rope_parameters, attention_bias / use_qk_norm read as they are, and the MoE keys.

Round trip: first_k_dense_replace is model.moe.dense_layers = [0, k) (every later block sparse), the shared
experts one SwiGLU of n_shared_experts x moe_intermediate_size (check.py refuses what config.json cannot
say), the router sigmoid scores with the correction bias (moe.score_func=sigmoid_bias). Exports carry no
multi-token-prediction layer: num_nextn_predict_layers=0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.moe.shapes import expert_dim


@dataclass(frozen=True)
class Glm4MoeHF(DenseHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        factor = float(m.partial_rotary_factor)
        out["rope_parameters"]["partial_rotary_factor"] = factor
        out["partial_rotary_factor"] = factor
        out.update({"attention_bias": bool(m.qkv_bias), "use_qk_norm": bool(m.qk_norm), **moe_to_hf(m)})
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        out = super().config_from_hf(c, where)
        rope = dict(c.get("rope_parameters") or {})
        out["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
        out["qkv_bias"] = bool(c.get("attention_bias", False))
        out["qk_norm"] = bool(c.get("use_qk_norm", False))
        out["moe"] = moe_from_hf(c, out["n_layers"], where, "GLM-4.5")
        return out


def moe_to_hf(m: Any) -> dict:
    """The MoE keys GLM-4.5's and DeepSeek-V3's config.json share."""
    moe = m.moe
    return {
        "moe_intermediate_size": expert_dim(m),
        "n_routed_experts": int(moe.num_experts),
        "num_experts_per_tok": int(moe.top_k),
        "n_shared_experts": int(moe.num_shared_experts),
        "n_group": int(moe.n_group),
        "topk_group": int(moe.topk_group),
        "norm_topk_prob": bool(moe.norm_topk),
        "routed_scaling_factor": float(moe.routed_scaling),
        "first_k_dense_replace": len(moe.dense_layers),
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
    }


def moe_from_hf(c: dict, n_layers: int, where: str, family: str) -> dict:
    """Those keys -> the model.moe section."""
    n = int(c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    if n < 1:
        raise InputError(f"{where}: config.json sets no n_routed_experts: it does not describe {family}'s experts")
    first_dense = min(int(c.get("first_k_dense_replace", 1)), n_layers)
    return {
        "num_experts": n,
        "top_k": int(c.get("num_experts_per_tok", 8)),
        "expert_dim": int(c["moe_intermediate_size"]),
        "num_shared_experts": int(c.get("n_shared_experts", 1)),
        "shared_expert_dim": None,
        "score_func": "sigmoid_bias",
        "norm_topk": bool(c.get("norm_topk_prob", True)),
        "n_group": int(c.get("n_group", 1)),
        "topk_group": int(c.get("topk_group", 1)),
        "routed_scaling": float(c.get("routed_scaling_factor", 1.0)),
        "aux_loss_coef": 0.0,
        "sparse_step": 1,
        "dense_layers": list(range(first_dense)),
    }
