"""DeepSeek-V3's config.json (DeepseekV3Config) <-> the model section: GLM-4.5's MoE keys (dtlaunch/models/
glm4_moe/hf.py: first_k_dense_replace, shared experts, the sigmoid router with its correction bias and
groups), the latent attention's widths (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim, rope_interleave), attention_bias (model.qkv_bias: q_a, kv_a and o) and YaRN rope scaling.
Exports carry no multi-token-prediction layer: num_nextn_predict_layers=0 (imports skip it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.glm4_moe.hf import moe_from_hf, moe_to_hf

_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class DeepseekV3HF(DenseHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        out.update({"attention_bias": bool(m.qkv_bias), **moe_to_hf(m)})
        rope = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
        yarn = m.yarn
        if yarn is not None:
            rope = {
                "rope_type": "yarn",
                "rope_theta": float(m.rope_theta),
                "factor": float(yarn.factor),
                "original_max_position_embeddings": int(yarn.original_max_seq_len),
                "beta_fast": float(yarn.beta_fast),
                "beta_slow": float(yarn.beta_slow),
                "mscale": float(yarn.mscale),
                "mscale_all_dim": float(yarn.mscale_all_dim),
            }
        out["rope_parameters"] = rope
        out["rope_scaling"] = None if yarn is None else {k: v for k, v in rope.items() if k != "rope_theta"}
        out.update({k: (None if getattr(m, k) is None else int(getattr(m, k))) for k in _MLA})
        out["head_dim"] = int(m.qk_rope_head_dim)  # what DeepseekV3Config sets itself
        out["rope_interleave"] = bool(m.rope_interleave)
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if scaling and kind != "yarn":
            raise InputError(f"{where}: rope scaling {kind!r} is not DeepSeek-V3's (yarn): use model.arch=hf_auto")
        plain = {k: v for k, v in c.items() if k not in ("rope_scaling", "head_dim")}
        plain["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", c.get("rope_theta"))}
        out = super().config_from_hf(plain, where)
        out.pop("qk_norm")
        out["head_dim"] = None
        out["qkv_bias"] = bool(c.get("attention_bias", False))
        out["moe"] = moe_from_hf(c, out["n_layers"], where, "DeepSeek-V3")
        missing = [k for k in _MLA if k not in c]
        if missing:
            raise InputError(f"{where}: config.json sets no {missing[0]}: it does not describe DeepSeek-V3's attention")
        out.update({k: (None if c[k] is None else int(c[k])) for k in _MLA})
        out["rope_interleave"] = bool(c.get("rope_interleave", True))
        out["yarn"] = None
        if scaling:
            factor = scaling.get("factor")
            original = int(scaling["original_max_position_embeddings"])
            out["yarn"] = {
                "factor": float(factor if factor is not None else out["max_seq_len"] / original),
                "original_max_seq_len": original,
                "beta_fast": float(scaling.get("beta_fast") or 32),
                "beta_slow": float(scaling.get("beta_slow") or 1),
                "mscale": float(scaling.get("mscale") or 0),
                "mscale_all_dim": float(scaling.get("mscale_all_dim") or 0),
            }
        return out
