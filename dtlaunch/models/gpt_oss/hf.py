"""gpt-oss's config.json <-> model section, as transformers' GptOssConfig reads it: the MoE decoder's keys
(num_local_experts, num_experts_per_tok, intermediate_size as the expert width) plus attention_bias (q, k,
v and o), layer_types with sliding_window, rope_parameters (yarn or default), swiglu_alpha / swiglu_limit.
Sinks, the router bias and the expert biases are always part of GptOssForCausalLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.moe.hf import MoEHF

_KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssHF(MoEHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        for key in ("rope_scaling", "rope_theta"):
            out.pop(key, None)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
        yarn = m.rope_yarn
        if yarn is not None:
            rope = {
                "rope_type": "yarn",
                "rope_theta": float(m.rope_theta),
                "factor": float(yarn.factor),
                "beta_fast": float(yarn.beta_fast),
                "beta_slow": float(yarn.beta_slow),
                "truncate": bool(yarn.truncate),
                "original_max_position_embeddings": int(yarn.original_max_seq_len),
            }
            if yarn.attention_factor is not None:
                rope["attention_factor"] = float(yarn.attention_factor)
        window = m.sliding_window
        kinds = list(m.layer_types or ()) or ["sliding_attention" if window else "full_attention"] * int(m.n_layers)
        out.update(
            {
                "rope_parameters": rope,
                "attention_bias": bool(m.qkv_bias),
                "sliding_window": window,
                "layer_types": kinds,
                "swiglu_alpha": float(m.swiglu_alpha),
                "swiglu_limit": float(m.swiglu_limit),
            }
        )
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        quant = (c.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise InputError(
                f"{where}: quantization_config.quant_method={quant!r} is not read natively (MXFP4 is): use a bf16 "
                f"copy or model.arch=hf_auto"
            )
        rope = dict(c.get("rope_parameters") or {})
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "yarn"):
            raise InputError(
                f"{where}: rope_type {kind!r} is not gpt-oss's (yarn or default natively): use model.arch=hf_auto"
            )
        theta = float(rope.get("rope_theta", c.get("rope_theta", 150000.0)))
        plain = {**c, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
        out = super().config_from_hf(plain, where)
        bias = bool(c.get("attention_bias", True))
        kinds = list(c.get("layer_types") or [])
        n = out["n_layers"]
        if not kinds:  # GptOssConfig's own default: sliding first, alternating
            kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(kinds) != n or any(k not in _KINDS for k in kinds):
            raise InputError(f"{where}: layer_types={kinds} is not one sliding_attention / full_attention per layer")
        window = c.get("sliding_window")
        if not window or all(k == "full_attention" for k in kinds):
            window, kinds = None, []
        limit = c.get("swiglu_limit", 7.0)
        out.update(
            {
                "qkv_bias": bias,
                "attention_out_bias": bias,
                "attention_sinks": True,
                "sliding_window": int(window) if window else None,
                "layer_types": kinds,
                "rope_theta": theta,
                "rope_yarn": None,
                "router_bias": True,
                "expert_biases": True,
                "swiglu_alpha": float(c.get("swiglu_alpha", 1.702)),
                "swiglu_limit": None if limit is None else float(limit),
            }
        )
        if kind == "yarn":
            out["rope_yarn"] = {
                "factor": float(rope["factor"]),
                "original_max_seq_len": int(rope["original_max_position_embeddings"]),
                "beta_fast": float(rope.get("beta_fast") or 32.0),
                "beta_slow": float(rope.get("beta_slow") or 1.0),
                "truncate": bool(rope.get("truncate", True)),
                "attention_factor": None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
            }
        return out
