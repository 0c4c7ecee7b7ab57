"""OLMo 3 <-> Hugging Face config.json: the dense decoder's vocabulary plus per-layer attention kinds,
RoPE settings per layer kind and OLMo 3's own defaults (Olmo3Config in transformers 5.24)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF

# Olmo3Config's defaults for the keys the dense adapter reads with other defaults.
_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False}
_THETA = 500_000.0
_WINDOW = 4096
# Olmo3Config's special-token defaults (OLMo's tokenizer). transformers builds the embedding with
# padding_idx=pad_token_id, which must lie inside the vocabulary: an id outside it is written as None.
_TOKEN_IDS = {"pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279}
_KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Olmo3HF(DenseHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        n, window = int(m.n_layers), getattr(m, "sliding_window", None)
        # Olmo3Config reads RoPE per layer kind (rope_parameters keyed by kind); ours is one for every layer.
        rope = out.pop("rope_parameters")
        out.pop("rope_theta"), out.pop("rope_scaling")
        out["rope_parameters"] = {kind: dict(rope) for kind in _KINDS}
        out["sliding_window"] = window
        kinds = list(m.layer_types or ())
        out["layer_types"] = kinds or ["sliding_attention" if window is not None else "full_attention"] * n
        out.update({k: (v if v is None or v < int(m.vocab_size) else None) for k, v in _TOKEN_IDS.items()})
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        # transformers' reading (Olmo3Config.convert_rope_params_to_dict): one entry per layer kind; a missing
        # one is default RoPE, the top-level rope_theta fills the full-attention entry only (the sliding one
        # gets 5e5), a legacy rope_scaling updates the full-attention entry only, and keys of an older flat
        # rope_parameters dict are not read at all.
        rope = dict(c.get("rope_parameters") or {})
        full, sliding = dict(rope.pop("full_attention", None) or {}), dict(rope.pop("sliding_attention", None) or {})
        full.setdefault("rope_type", "default")
        full.setdefault("rope_theta", c.get("rope_theta", _THETA))
        sliding.setdefault("rope_type", "default")
        sliding.setdefault("rope_theta", _THETA)
        if c.get("rope_scaling"):
            full.update(c["rope_scaling"])
        if set(rope) - set(full) or any(rope.get(k, v) != v for k, v in full.items()):
            raise InputError(
                f"{where}: rope_parameters={c.get('rope_parameters')} is one flat dict, which transformers' Olmo3Config "
                f"does not read (it uses {full} for every layer): give rope_parameters per layer kind "
                f"(full_attention, sliding_attention)"
            )
        if full != sliding:
            raise InputError(
                f"{where}: RoPE settings differ between full-attention ({full}) and sliding-attention ({sliding}) "
                f"layers, which the native olmo3 decoder does not support (one RoPE for all layers): use model.arch=hf_auto"
            )
        c = {**_DEFAULTS, **{k: v for k, v in c.items() if k not in ("rope_scaling", "rope_theta")}}
        c["rope_parameters"] = full
        out = super().config_from_hf(c, where)
        n = out["n_layers"]
        kinds = c.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
        if len(kinds) < n or any(k not in _KINDS for k in kinds[:n]):
            raise InputError(
                f"{where}: layer_types={kinds} needs one entry per layer (num_hidden_layers={n}), each "
                f"sliding_attention or full_attention: fix config.json"
            )
        window = c.get("sliding_window", _WINDOW)
        sliding_any = any(k == "sliding_attention" for k in kinds[:n])
        out["sliding_window"] = int(window) if window and sliding_any else None
        out["layer_types"] = list(kinds[:n]) if out["sliding_window"] else []
        out["post_norm"] = True
        out["qk_norm_whole"] = True
        return out
