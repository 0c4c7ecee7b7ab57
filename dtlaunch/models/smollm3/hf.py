"""SmolLM3 <-> Hugging Face config.json: the dense decoder's vocabulary plus NoPE layers and SmolLM3's
own defaults. Tensor names and the RoPE permutation are the dense decoder's (models/dense/hf.py): a
NoPE layer's q and k rows are permuted too, which is harmless (q·k sums over the same permutation of
both) and keeps every layer's tensors read the same way, slices included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.models.dense.hf import DenseHF

# SmolLM3Config's defaults for the keys the dense adapter reads with other defaults.
_DEFAULTS = {
    "rope_theta": 2_000_000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "no_rope_layer_interval": 4,
}
# SmolLM3Config's special-token defaults (SmolLM3-3B's tokenizer). transformers builds the embedding
# with padding_idx=pad_token_id, which must lie inside the vocabulary: an id outside it is written as None.
_TOKEN_IDS = {"pad_token_id": 128004, "bos_token_id": 128000, "eos_token_id": 128001}


@dataclass(frozen=True)
class SmolLM3HF(DenseHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        n, nope = int(m.n_layers), set(m.no_rope_layers or ())
        window = getattr(m, "sliding_window", None)
        # HF's list holds a use-RoPE flag per layer (1 = RoPE), ours the NoPE layers' indices.
        out["no_rope_layers"] = [0 if i in nope else 1 for i in range(n)]
        out["use_sliding_window"] = window is not None
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if window is not None else "full_attention"] * n
        out.update({k: (v if v < int(m.vocab_size) else None) for k, v in _TOKEN_IDS.items()})
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        rope = c.get("rope_parameters") or {}
        c = {
            **{k: v for k, v in _DEFAULTS.items() if k != "rope_theta"},
            "rope_theta": rope.get("rope_theta", _DEFAULTS["rope_theta"]),
            **c,
        }
        out = super().config_from_hf(c, where)
        n = out["n_layers"]
        flags = c.get("no_rope_layers")
        if flags is None:  # transformers' rule: every no_rope_layer_interval-th layer is NoPE
            interval = int(c["no_rope_layer_interval"])
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) < n:
            raise InputError(
                f"{where}: no_rope_layers has {len(flags)} entries for num_hidden_layers={n}: give one per layer"
            )
        out["no_rope_layers"] = [i for i in range(n) if not flags[i]]
        out["sliding_window"] = self._smollm3_window(c, flags[:n], where)
        return out

    @staticmethod
    def _smollm3_window(c: dict, flags: list, where: str) -> Any:
        """transformers' rule: a layer slides when use_sliding_window and its layer_types entry says so
        (by default the NoPE layers); a window on some layers only is refused (one window for all here)."""
        window = c.get("sliding_window")
        if not (c.get("use_sliding_window") and window):
            return None
        kinds = c.get("layer_types") or ["full_attention" if f else "sliding_attention" for f in flags]
        sliding = [k == "sliding_attention" for k in kinds[: len(flags)]]
        if all(sliding):
            return int(window)
        if not any(sliding):
            return None
        raise InputError(
            f"{where}: sliding-window attention on some layers only is not supported natively: use model.arch=hf_auto"
        )
