"""Gemma 3 (text) <-> Hugging Face config.json: the dense decoder's vocabulary plus per-layer attention
kinds, the two RoPE bases and Gemma 3's own defaults, read as transformers 5.24's Gemma3TextConfig reads
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.dense.shapes import head_dim

# Gemma3TextConfig's defaults for the keys the dense adapter reads with other defaults.
_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "head_dim": 256,
}
_GLOBAL_THETA, _LOCAL_THETA, _WINDOW, _PATTERN, _SCALAR = 1_000_000.0, 10_000.0, 4096, 6, 256
# Gemma's special-token ids. transformers builds the embedding with padding_idx=pad_token_id, which must
# lie inside the vocabulary: an id outside it is written as None.
_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma3HF(DenseHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "hidden_act"):
            out.pop(key)
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
        if m.rope_linear_factor:
            full = {"rope_type": "linear", "factor": float(m.rope_linear_factor), "rope_theta": float(m.rope_theta)}
        sliding = {"rope_type": "default", "rope_theta": float(m.rope_local_theta)}
        window = m.sliding_window
        kinds = list(m.layer_types or ())
        # Gemma3TextConfig types it int (strict): a whole number is written as one.
        scalar = float(m.query_pre_attn_scalar or head_dim(m))
        out.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
                "query_pre_attn_scalar": int(scalar) if scalar.is_integer() else scalar,
                "sliding_window": window,
                "layer_types": kinds or ["sliding_attention" if window else "full_attention"] * int(m.n_layers),
                "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
                "use_bidirectional_attention": False,
            }
        )
        out.update({k: (v if v < int(m.vocab_size) else None) for k, v in _TOKEN_IDS.items()})
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if c.get(key) is not None:
                raise InputError(
                    f"{where}: {key}={c[key]} (Gemma 2's tanh soft-capping) is not part of the native gemma3 "
                    f"decoder, whose attention kernels cannot cap scores: use model.arch=hf_auto"
                )
        if c.get("use_bidirectional_attention"):
            raise InputError(
                f"{where}: use_bidirectional_attention=true (an encoder) is not a causal LM: use model.arch=hf_auto"
            )
        act = c.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise InputError(
                f"{where}: hidden_activation={act!r}, the native gemma3 decoder uses gelu_pytorch_tanh: "
                f"use model.arch=hf_auto"
            )
        full, sliding = self._rope(c, where)
        c = {
            **_DEFAULTS,
            **{k: v for k, v in c.items() if k not in ("rope_scaling", "rope_parameters", "hidden_act")},
            "rope_theta": full["rope_theta"],
        }
        out = super().config_from_hf(c, where)
        n = out["n_layers"]
        pattern = int(c.get("sliding_window_pattern", _PATTERN))
        kinds = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
        if len(kinds) < n or any(k not in _KINDS for k in kinds[:n]):
            raise InputError(
                f"{where}: layer_types={kinds} needs one entry per layer (num_hidden_layers={n}), each "
                f"sliding_attention or full_attention: fix config.json"
            )
        window = c.get("sliding_window", _WINDOW)
        out.update(
            {
                "sliding_window": int(window) if window else None,
                # Kept without a window too: the RoPE base still follows each layer's kind.
                "layer_types": list(kinds[:n]),
                "sandwich_norm": True,
                "norm_offset": 1.0,
                "embed_scale": True,
                "mlp_activation": "gelu_tanh",
                "query_pre_attn_scalar": float(c.get("query_pre_attn_scalar", _SCALAR)),
                "rope_local_theta": float(sliding["rope_theta"]),
                "rope_linear_factor": float(full["factor"]) if full["rope_type"] == "linear" else None,
            }
        )
        return out

    @staticmethod
    def _rope(c: dict, where: str) -> tuple[dict, dict]:
        """transformers' reading (Gemma3TextConfig.convert_rope_params_to_dict): rope_parameters per layer
        kind, a missing one default RoPE; a legacy rope_scaling updates the full-attention entry; the
        top-level rope_theta fills the full-attention base (1e6 when absent), rope_local_base_freq the
        sliding one (1e4)."""
        rope = dict(c.get("rope_parameters") or {})
        full = dict(rope.pop("full_attention", None) or {"rope_type": "default"})
        sliding = dict(rope.pop("sliding_attention", None) or {"rope_type": "default"})
        if rope:
            raise InputError(
                f"{where}: rope_parameters keys {sorted(rope)} are not read by transformers' Gemma3TextConfig "
                f"(it reads one entry per layer kind): give rope_parameters as full_attention / sliding_attention"
            )
        if c.get("rope_scaling"):
            full.update(c["rope_scaling"])
        full.setdefault("rope_theta", c.get("rope_theta", _GLOBAL_THETA))
        sliding.setdefault("rope_theta", c.get("rope_local_base_freq", _LOCAL_THETA))
        for entry in (full, sliding):
            entry["rope_type"] = entry.get("rope_type", entry.pop("type", "default"))
        if sliding["rope_type"] != "default" or full["rope_type"] not in ("default", "linear"):
            raise InputError(
                f"{where}: RoPE {full['rope_type']!r} (full attention) / {sliding['rope_type']!r} (sliding) is not "
                f"supported natively (default, and linear on the full-attention layers): use model.arch=hf_auto"
            )
        return full, sliding
