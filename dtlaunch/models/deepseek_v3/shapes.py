"""Closed-form shapes and parameter counts of the deepseek_v3 decoder (pure Python: planner and validators).

The MoE decoder's counts (dtlaunch/models/moe/shapes.py) with multi-head latent attention in place of the
q/k/v/o projections: what differs is one block's attention, everything else is the MoE decoder's.
"""

from __future__ import annotations

import math
from typing import Any

from dtlaunch.models.dense import shapes as dense
from dtlaunch.models.dense.shapes import ffn_dim
from dtlaunch.models.moe import shapes as moe
from dtlaunch.models.moe.shapes import expert_dim, is_sparse, shared_dim


def qk_head_dim(m: Any) -> int:
    return int(m.qk_nope_head_dim) + int(m.qk_rope_head_dim)


def mla_linears(m: Any) -> dict[str, tuple[int, int]]:
    """The attention's linears by Hugging Face name: (out features, in features)."""
    h, heads, qk = int(m.dim), int(m.n_heads), qk_head_dim(m)
    out: dict[str, tuple[int, int]] = {}
    if m.q_lora_rank:
        out["q_a_proj"] = (int(m.q_lora_rank), h)
        out["q_b_proj"] = (heads * qk, int(m.q_lora_rank))
    else:
        out["q_proj"] = (heads * qk, h)
    out["kv_a_proj_with_mqa"] = (int(m.kv_lora_rank) + int(m.qk_rope_head_dim), h)
    out["kv_b_proj"] = (heads * (int(m.qk_nope_head_dim) + int(m.v_head_dim)), int(m.kv_lora_rank))
    out["o_proj"] = (h, heads * int(m.v_head_dim))
    return out


def block_norm_params(m: Any) -> int:
    """The block's two norms and the latent attention's: the low-rank query's and the kv latent's."""
    return 2 * int(m.dim) + int(m.q_lora_rank or 0) + int(m.kv_lora_rank)


def attention_params(m: Any) -> int:
    """A block without its FFN: the latent attention's linears (+ q_a / kv_a / o biases) and the norm gains."""
    linears = mla_linears(m)
    total = sum(o * i for o, i in linears.values()) + block_norm_params(m)
    if getattr(m, "qkv_bias", False):
        total += sum(linears[k][0] for k in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj") if k in linears)
    return total


def layer_params(m: Any, layer: int) -> dict[str, int]:
    """One block's parameters: {"routed": routed experts, "other": attention, norms, router, shared / dense FFN}."""
    if not is_sparse(m, layer):
        return {"routed": 0, "other": attention_params(m) + 3 * int(m.dim) * ffn_dim(m)}
    other = attention_params(m) + int(m.moe.num_experts) * int(m.dim) + 3 * int(m.dim) * shared_dim(m)
    return {"routed": moe.routed_params(m), "other": other}


def active_layer_params(m: Any, layer: int) -> int:
    """Parameters one token multiplies in a block: its top-k routed experts, not all of them."""
    p = layer_params(m, layer)
    if not is_sparse(m, layer):
        return p["other"]
    return p["other"] + 3 * int(m.moe.top_k) * int(m.dim) * expert_dim(m)


def blocks_params(m: Any) -> int:
    return sum(sum(layer_params(m, i).values()) for i in range(int(m.n_layers)))


def block_params(m: Any) -> int:
    """The mean block (the planner sizes a stage as layers x block)."""
    return round(blocks_params(m) / int(m.n_layers))


def param_count(m: Any) -> int:
    return dense.embedding_params(m) + dense.head_params(m) + int(m.dim) + blocks_params(m)


def tp_divisors(m: Any) -> list[tuple[str, int]]:
    """The MoE decoder's (heads, experts' widths, ...) less the kv heads, which latent attention has not:
    each rank holds whole heads of wq / wq_b, wkv_b and wo (tp_plan.py)."""
    return [d for d in moe.tp_divisors(m) if d[0] != "model.n_kv_heads"]


def block_linears(m: Any, hf: bool = True) -> dict[str, tuple[int, int, bool | None]]:
    """One sparse block's linears by Hugging Face name (what LoRA adapts): the latent attention's, the
    router's gate and the shared experts' SwiGLU, with their tensor-parallel split (tp_plan.py: True
    column-parallel, False row-parallel, None whole on every rank)."""
    split = {"q_proj": True, "q_b_proj": True, "kv_b_proj": True, "o_proj": False}
    out: dict[str, tuple[int, int, bool | None]] = {k: (o, i, split.get(k)) for k, (o, i) in mla_linears(m).items()}
    out["gate"] = (int(m.moe.num_experts), int(m.dim), None)
    fs = shared_dim(m)
    if fs:
        out.update({"gate_proj": (fs, m.dim, True), "up_proj": (fs, m.dim, True), "down_proj": (m.dim, fs, False)})
    return out


def whole_under_tp(m: Any) -> int:
    """One block's attention parameters tensor parallel leaves whole on every rank (norms aside): the
    low-rank wq_a and wkv_a (and their biases)."""
    linears = mla_linears(m)
    bias = bool(getattr(m, "qkv_bias", False))
    return sum(o * i + (o if bias else 0) for k, (o, i) in linears.items() if k in ("q_a_proj", "kv_a_proj_with_mqa"))


def kv_cache_values(m: Any, tp: int = 1) -> int:
    """Values one block's decoding cache holds per position and row (mla.py): the normalised kv latent and
    the rotated key every head shares, the same on every tensor-parallel rank (wkv_a and kv_norm are whole)."""
    return int(m.kv_lora_rank) + int(m.qk_rope_head_dim)


def decode_derived_values(m: Any, tp: int = 1) -> float:
    """Values one block keeps for a generation besides its cache (mla.py's absorbed matrix): wkv_b's matrix,
    kv_lora_rank x this rank's heads x (qk_nope_head_dim + v_head_dim)."""
    return int(m.kv_lora_rank) * int(m.n_heads) * (int(m.qk_nope_head_dim) + int(m.v_head_dim)) / tp


def softmax_mscale(m: Any) -> float:
    """YaRN's factor on the softmax scale, mscale(factor, mscale_all_dim)^2 (1 without YaRN), as
    transformers' DeepSeek-V3 attention scales it."""
    yarn = getattr(m, "yarn", None)
    if yarn is None or not yarn.mscale_all_dim or float(yarn.factor) <= 1:
        return 1.0
    return (0.1 * float(yarn.mscale_all_dim) * math.log(float(yarn.factor)) + 1.0) ** 2


embedding_params = dense.embedding_params
head_params = dense.head_params
