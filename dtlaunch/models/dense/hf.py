"""The dense decoder <-> Hugging Face (Llama / Qwen2 / Qwen3 / Mistral): tensor names, RoPE layout and
config.json. Pure Python apart from reshaping the tensors it is handed (no torch import).

RoPE layout: our attention rotates *interleaved* pairs (dims 2i, 2i+1) while HF rotates *halves*
(dims i, i + d/2), so within each head the rows of wq and wk (and their biases, and the q/k norm
gains, which act on the same per-head dims) are permuted on export (row 2i+k -> row k*d/2 + i) and
back on import. The norms' mean square does not depend on the order of the dims, so the permuted
model computes the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.errors import InputError
from dtlaunch.models.dense.shapes import ffn_dim, head_dim, kv_heads

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig

# Ours -> HF, per block.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_FROM_HF = {v: k for k, v in _BLOCK_NAMES.items()}
_TOP_FROM_HF = {v: k for k, v in _TOP_NAMES.items()}


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter '{name}'")


def from_hf_name(name: str) -> str:
    if name in _TOP_FROM_HF:
        return _TOP_FROM_HF[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _BLOCK_FROM_HF:
        return f"layers.{m.group(1)}.{_BLOCK_FROM_HF[m.group(2)]}"
    raise InputError(f"unexpected tensor {name}: this architecture has no such parameter")


def interleaved_to_halves(w: Any, n_heads: int) -> Any:
    """Rows (dim 0) of a q/k projection, bias or norm gain, per head: ours (pairs 2i, 2i+1) -> HF (i, i + d/2)."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def halves_to_interleaved(w: Any, n_heads: int) -> Any:
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def rope_heads(name: str, m: ModelConfig) -> Optional[int]:
    """Heads to permute within for a RoPE-rotated tensor (HF keeps each head's rotary halves, we interleave
    them); None for the others. Part of a family's names module: the importer reads slices by it."""
    if re.search(r"attention\.wq\.(weight|bias)$", name):
        return int(m.n_heads)
    if re.search(r"attention\.wk\.(weight|bias)$", name):
        return kv_heads(m)
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one gain vector of head_dim entries, shared by the heads
    return None


def renamed_to_hf(name: str, renames: dict[str, str]) -> str:
    """to_hf_name for a family whose block tensors `renames` maps (ours -> HF, under layers.N.) and whose
    other names are the dense decoder's (gemma3, olmo3: their norms)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in renames:
        return f"model.layers.{m.group(1)}.{renames[m.group(2)]}"
    return to_hf_name(name)


def renamed_from_hf(name: str, renames: dict[str, str]) -> str:
    """from_hf_name for such a family; `renames` maps HF -> ours."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in renames:
        return f"layers.{m.group(1)}.{renames[m.group(2)]}"
    return from_hf_name(name)


def to_hf_state(state: dict, m: Any, hf_name: Any = None, heads_of: Any = None) -> dict:
    """Our parameter dict -> HF's names and RoPE layout (contiguous tensors, ready for safetensors).
    A tied head is written once, as the embedding (transformers re-ties it from config.json). A family
    with names or RoPE rows of its own passes its `to_hf_name` and `rope_heads` (gemma3, olmo3)."""
    hf_name, heads_of = hf_name or to_hf_name, heads_of or rope_heads
    out = {}
    for name, t in state.items():
        if name == "output.weight" and getattr(m, "tie_embeddings", False):
            continue
        heads = heads_of(name, m)
        t = interleaved_to_halves(t, heads) if heads else t
        out[hf_name(name)] = t.contiguous()
    return out


def from_hf_state(state: dict, m: Any, our_name: Any = None, heads_of: Any = None) -> dict:
    """HF's tensors -> our names and RoPE layout; `our_name`, `heads_of`: a family's own (see to_hf_state)."""
    our_name, heads_of = our_name or from_hf_name, heads_of or rope_heads
    out = {}
    for hf_name, t in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config; some exports carry it
        if hf_name == "lm_head.weight" and getattr(m, "tie_embeddings", False):
            continue  # some tied exports also write the head; the embedding is the one parameter
        name = our_name(hf_name)
        heads = heads_of(name, m)
        out[name] = (halves_to_interleaved(t, heads) if heads else t).contiguous()
    return out


@dataclass(frozen=True)
class DenseHF:
    """One family's config.json vocabulary: which architecture name and model_type it writes, and
    which of the decoder's flags that family fixes (True/False) or reads from config.json (None)."""

    architecture: str
    model_type: str
    qkv_bias: Optional[bool] = False
    qk_norm: bool = False
    sliding: bool = False  # honours config.json's sliding_window
    # config.json's sliding_window applies to every layer (Mistral, Mixtral), not per layer_types (Qwen).
    uniform_window: bool = False
    # Keys this family's config.json always carries (e.g. Llama's attention_bias / mlp_bias).
    extra_config: tuple[tuple[str, Any], ...] = ()

    def config_to_hf(self, m: ModelConfig, dtype: str = "float32") -> dict:
        rs = m.rope_scaling
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
        if rs is not None:
            rope = {
                "rope_type": "llama3",
                "rope_theta": float(m.rope_theta),
                "factor": float(rs.factor),
                "low_freq_factor": float(rs.low_freq_factor),
                "high_freq_factor": float(rs.high_freq_factor),
                "original_max_position_embeddings": int(rs.original_max_seq_len),
            }
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": int(m.dim),
            "intermediate_size": ffn_dim(m),
            "num_hidden_layers": int(m.n_layers),
            "num_attention_heads": int(m.n_heads),
            "num_key_value_heads": kv_heads(m),
            "head_dim": head_dim(m),
            "vocab_size": int(m.vocab_size),
            "rms_norm_eps": float(m.norm_eps),
            "rope_theta": float(m.rope_theta),
            "rope_scaling": None if rs is None else {k: v for k, v in rope.items() if k != "rope_theta"},
            "rope_parameters": rope,
            "max_position_embeddings": int(m.max_seq_len),
            "hidden_act": "silu",
            "tie_word_embeddings": bool(getattr(m, "tie_embeddings", False)),
            "torch_dtype": dtype,
            "dtype": dtype,
        }
        out.update(dict(self.extra_config))
        if self.sliding:
            window = getattr(m, "sliding_window", None)
            out["sliding_window"] = window
            if self.model_type not in ("mistral", "mixtral"):
                out["use_sliding_window"] = window is not None
                out["max_window_layers"] = 0 if window is not None else int(m.n_layers)
                kind = "sliding_attention" if window is not None else "full_attention"
                out["layer_types"] = [kind] * int(m.n_layers)
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        """config.json -> the model section's fields (every size; flags this family implies)."""
        if c.get("hidden_act", "silu") != "silu":
            raise InputError(f"{where}: hidden_act={c['hidden_act']!r}, the {self.architecture} decoder uses silu")
        for key in ("attention_bias", "mlp_bias"):
            if c.get(key) and not (key == "attention_bias" and self.qkv_bias is None):
                raise InputError(
                    f"{where}: {key}=true is not part of dtlaunch's {self.architecture}: use model.arch=hf_auto"
                )
        rope = dict(c.get("rope_parameters") or {})
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        n_heads = int(c["num_attention_heads"])
        out: dict[str, Any] = {
            "arch": "",  # filled by the caller (the registry entry's key)
            "dim": int(c["hidden_size"]),
            "n_layers": int(c["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(c.get("num_key_value_heads") or n_heads),
            "vocab_size": int(c["vocab_size"]),
            "ffn_dim": int(c["intermediate_size"]),
            "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(theta),
            "max_seq_len": int(c.get("max_position_embeddings", 2048)),
            "head_dim": int(c.get("head_dim") or int(c["hidden_size"]) // n_heads),
            "qkv_bias": bool(self.qkv_bias),
            "qk_norm": self.qk_norm,
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "sliding_window": None,
            "rope_scaling": None,
        }
        if scaling:
            if scaling.get("rope_type", scaling.get("type")) != "llama3":
                raise InputError(
                    f"{where}: rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                    f"natively (llama3 is): use model.arch=hf_auto"
                )
            out["rope_scaling"] = {
                "factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_seq_len": int(scaling["original_max_position_embeddings"]),
            }
        if self.sliding:
            out["sliding_window"] = self._window(c, out["n_layers"], where)
        return out

    def _window(self, c: dict, n_layers: int, where: str) -> Optional[int]:
        """The attention window of every layer, or None; mixed full / sliding layers are refused."""
        window = c.get("sliding_window")
        if not window:
            return None
        if self.uniform_window:
            return int(window)
        kinds = c.get("layer_types")
        if kinds is None:  # older Qwen configs: the first max_window_layers layers attend fully
            if not c.get("use_sliding_window", False):
                return None
            full = int(c.get("max_window_layers", n_layers))
            kinds = ["full_attention"] * min(full, n_layers) + ["sliding_attention"] * max(0, n_layers - full)
        if all(k == "full_attention" for k in kinds):
            return None
        if all(k == "sliding_attention" for k in kinds):
            return int(window)
        raise InputError(
            f"{where}: sliding-window attention on some layers only is not supported natively: use model.arch=hf_auto"
        )
