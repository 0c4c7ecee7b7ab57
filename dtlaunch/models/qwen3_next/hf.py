"""Qwen3-Next's config.json (Qwen3NextConfig) <-> the model section: the dense keys, partial RoPE in
rope_parameters, the layer kinds, the Gated DeltaNet widths (`GatedDeltaNetHF`, which Qwen3.5 shares), and
the MoE keys (Qwen's sparse-step rule, one shared expert of shared_expert_intermediate_size with its
sigmoid gate).

transformers writes every routed expert's projections as tensors of their own and fuses them when it loads
(dtlaunch/models/moe/hf.py reads and writes that layout). Exports carry no multi-token-prediction block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.moe.shapes import expert_dim, shared_dim
from dtlaunch.models.qwen3_next.config import layer_kinds

_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_LINEAR += ("linear_conv_kernel_dim",)
_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class GatedDeltaNetHF(DenseHF):
    """The hybrid decoder's keys: the dense ones, partial RoPE, the layer kinds and the linear blocks' widths."""

    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        factor = float(m.partial_rotary_factor)
        out["rope_parameters"]["partial_rotary_factor"] = factor
        out["partial_rotary_factor"] = factor
        out.update({key: int(getattr(m, key)) for key in _LINEAR})
        out.update({"attention_bias": False, "layer_types": layer_kinds(m)})
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        out = super().config_from_hf(c, where)
        rope = dict(c.get("rope_parameters") or {})
        out["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        out.update({key: int(c[key]) for key in _LINEAR if key in c})
        kinds = list(c.get("layer_types") or [])
        bad = sorted({k for k in kinds if k not in _KINDS})
        if bad:
            raise InputError(f"{where}: layer_types {bad} are not {self.architecture}'s ({', '.join(_KINDS)})")
        out["layer_types"] = kinds
        return out


@dataclass(frozen=True)
class Qwen3NextHF(GatedDeltaNetHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        moe = m.moe
        out.update(
            {
                "num_experts": int(moe.num_experts),
                "num_experts_per_tok": int(moe.top_k),
                "moe_intermediate_size": expert_dim(m),
                "shared_expert_intermediate_size": shared_dim(m),
                "norm_topk_prob": bool(moe.norm_topk),
                "decoder_sparse_step": int(moe.sparse_step),
                "mlp_only_layers": sorted(int(i) for i in moe.dense_layers),
                "router_aux_loss_coef": float(moe.aux_loss_coef),
                "output_router_logits": False,
            }
        )
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        out = super().config_from_hf(c, where)
        n = int(c.get("num_experts") or 0)
        if n < 1:
            raise InputError(
                f"{where}: config.json sets no num_experts: it does not describe {self.architecture}'s experts"
            )
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        out["moe"] = {
            "num_experts": n,
            "top_k": int(c.get("num_experts_per_tok", 10)),
            "expert_dim": int(c["moe_intermediate_size"]),
            "num_shared_experts": 1 if shared else 0,
            "shared_expert_dim": shared or None,
            "score_func": "softmax",
            "norm_topk": bool(c.get("norm_topk_prob", True)),
            "aux_loss_coef": float(c.get("router_aux_loss_coef") or 0.0) if c.get("output_router_logits") else 0.0,
            "sparse_step": int(c.get("decoder_sparse_step", 1)),
            "dense_layers": [int(i) for i in c.get("mlp_only_layers") or []],
        }
        return out
