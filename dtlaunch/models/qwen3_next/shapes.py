"""Closed-form shapes, parameter counts and FLOPs of the Gated DeltaNet hybrid decoders, qwen3_next and
qwen3_5 / qwen3_5_moe (pure Python).

A block is a Gated DeltaNet block (model.layer_types linear_attention) or a gated full-attention block
(full_attention: q_proj twice as wide, the second half the output gate; per-head q/k norms), each with two
norms and the MoE FFN (router, routed experts, one shared expert and its one-output gate) or, without a
model.moe section (qwen3_5), in model.moe.dense_layers or off the sparse step, the dense SwiGLU. Split
(Qwen3.5) and fused (Qwen3-Next) input projections hold the same weights: only their names differ.
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import shapes as dense
from dtlaunch.models.dense.shapes import ffn_dim, head_dim, kv_heads
from dtlaunch.models.moe import shapes as moe
from dtlaunch.models.moe.shapes import is_sparse, routed_params, shared_dim
from dtlaunch.models.qwen3_next.config import layer_kinds


def linear_widths(m: Any) -> tuple[int, int, int]:
    """(key width, value width, conv channels) of a Gated DeltaNet block: q and k are key-wide, v value-wide."""
    key = int(m.linear_num_key_heads) * int(m.linear_key_head_dim)
    value = int(m.linear_num_value_heads) * int(m.linear_value_head_dim)
    return key, value, 2 * key + value


def linear_attention_params(m: Any) -> int:
    key, value, conv = linear_widths(m)
    nv = int(m.linear_num_value_heads)
    proj = int(m.dim) * (2 * key + 2 * value) + int(m.dim) * 2 * nv + value * int(m.dim)
    return proj + conv * int(m.linear_conv_kernel_dim) + 2 * nv + int(m.linear_value_head_dim)


def full_attention_params(m: Any) -> int:
    h, d = int(m.dim), head_dim(m)
    q, k = int(m.n_heads) * d, kv_heads(m) * d
    return 2 * h * q + 2 * h * k + h * q + 2 * d  # q_proj (query and gate), k, v, o; q/k norm gains


def _sparse(m: Any, layer: int) -> bool:
    return getattr(m, "moe", None) is not None and is_sparse(m, layer)


def ffn_params(m: Any, layer: int) -> dict[str, int]:
    """{"routed": the routed experts (what expert parallel shards), "other": router, shared expert and gate}."""
    h = int(m.dim)
    if not _sparse(m, layer):
        return {"routed": 0, "other": 3 * h * ffn_dim(m)}
    fs = shared_dim(m)
    shared = 3 * h * fs + (h if fs and getattr(m, "shared_expert_gate", False) else 0)
    return {"routed": routed_params(m), "other": int(m.moe.num_experts) * h + shared}


def layer_params(m: Any, layer: int) -> dict[str, int]:
    kind = layer_kinds(m)[layer]
    mixer = linear_attention_params(m) if kind == "linear_attention" else full_attention_params(m)
    ffn = ffn_params(m, layer)
    return {"routed": ffn["routed"], "other": ffn["other"] + mixer + 2 * int(m.dim)}


def active_layer_params(m: Any, layer: int) -> int:
    p = layer_params(m, layer)
    if not _sparse(m, layer):
        return p["other"]
    return p["other"] + p["routed"] * int(m.moe.top_k) // int(m.moe.num_experts)


def blocks_params(m: Any) -> int:
    return sum(sum(layer_params(m, i).values()) for i in range(int(m.n_layers)))


def block_params(m: Any) -> int:
    """The mean block."""
    return round(blocks_params(m) / int(m.n_layers))


def block_norm_params(m: Any) -> int:
    return 2 * int(m.dim)


def param_count(m: Any) -> int:
    return dense.embedding_params(m) + dense.head_params(m) + int(m.dim) + blocks_params(m)


def matmul_params(m: Any) -> int:
    """Active parameters in matmuls: blocks' active weights + the output head (not the embedding lookup)."""
    blocks = sum(active_layer_params(m, i) for i in range(int(m.n_layers)))
    return blocks + int(m.vocab_size) * int(m.dim) + int(m.dim)


def flops_per_token(m: Any, seq_len: int) -> float:
    """6 x active matmul parameters, softmax attention on the full blocks only (12·H·d·s per block), and the
    linear blocks' state reads and writes (chunked delta rule: about 12·Hv·dk·dv per token, whatever s)."""
    kinds = layer_kinds(m)
    full = sum(k == "full_attention" for k in kinds)
    linear = len(kinds) - full
    state = 12 * int(m.linear_num_value_heads) * int(m.linear_key_head_dim) * int(m.linear_value_head_dim)
    return 6.0 * matmul_params(m) + 12 * full * int(m.n_heads) * head_dim(m) * seq_len + linear * state


def tp_divisors(m: Any) -> list[tuple[str, int]]:
    """The MoE decoder's (or, without model.moe, the dense decoder's) and the linear blocks' key heads: a rank
    takes whole key heads and the value heads they serve (a multiple of the key heads, check.py)."""
    base = moe.tp_divisors(m) if getattr(m, "moe", None) is not None else dense.tp_divisors(m)
    return [("model.linear_num_key_heads", int(m.linear_num_key_heads)), *base]


def block_linears(m: Any, split: bool = False) -> dict[str, tuple[int, int, bool | None]]:
    """The linears LoRA can adapt, by Hugging Face module name, of the full-attention and linear blocks and
    the shared expert (qwen3_5: the dense MLP): (out features, in features, column-parallel under TP; None:
    whole on every TP rank, the router's gate). Qwen3.5's in_proj_qkv is stored split on its rows and each
    rank computes its heads' outputs (tp_plan.py): column-parallel in what it holds and returns. `split`:
    Qwen3.5's four input projections of the linear blocks."""
    h, d = int(m.dim), head_dim(m)
    q, k = int(m.n_heads) * d, kv_heads(m) * d
    key, value, conv = linear_widths(m)
    nv = int(m.linear_num_value_heads)
    out: dict[str, tuple[int, int, bool | None]] = {
        "q_proj": (2 * q, h, True),
        "k_proj": (k, h, True),
        "v_proj": (k, h, True),
        "o_proj": (h, q, False),
    }
    if split:
        out.update({"in_proj_qkv": (conv, h, True), "in_proj_z": (value, h, True)})
        out.update({"in_proj_b": (nv, h, True), "in_proj_a": (nv, h, True)})
    else:
        out.update({"in_proj_qkvz": (2 * key + 2 * value, h, True), "in_proj_ba": (2 * nv, h, True)})
    out["out_proj"] = (h, value, False)
    moe_section = getattr(m, "moe", None) is not None
    if moe_section:
        out["gate"] = (int(m.moe.num_experts), h, None)
    fs = shared_dim(m) if moe_section else ffn_dim(m)
    if fs:
        out.update({"gate_proj": (fs, h, True), "up_proj": (fs, h, True), "down_proj": (h, fs, False)})
    return out


embedding_params = dense.embedding_params
head_params = dense.head_params
