"""Closed-form shapes and parameter counts of the MoE decoder (pure Python: planner and validators).

A block is the dense decoder's block (attention, norms) whose SwiGLU is, on the sparse blocks, a router
(dim x experts), `num_experts` routed SwiGLUs of width expert_dim and optionally one shared SwiGLU.
Counts are split into routed-expert parameters (what expert parallelism shards) and the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.models.dense import shapes as dense
from dtlaunch.models.dense.shapes import ffn_dim

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


def is_sparse(m: Any, layer: int) -> bool:
    """Qwen's rule (decoder_sparse_step, mlp_only_layers): every sparse_step-th block, bar the dense ones."""
    moe = m.moe
    return int(moe.num_experts) > 0 and layer not in set(moe.dense_layers) and (layer + 1) % int(moe.sparse_step) == 0


def sparse_layers(m: ModelConfig) -> list[int]:
    return [i for i in range(int(m.n_layers)) if is_sparse(m, i)]


def expert_dim(m: Any) -> int:
    return int(m.moe.expert_dim or ffn_dim(m))


def shared_dim(m: Any) -> int:
    """Width of the one SwiGLU holding the shared experts (0: none)."""
    n = int(m.moe.num_shared_experts)
    return 0 if n == 0 else int(m.moe.shared_expert_dim or n * expert_dim(m))


def attention_params(m: ModelConfig) -> int:
    """A block without its FFN: attention projections (+ biases) and norm gains."""
    return dense.block_params(m) - 3 * m.dim * ffn_dim(m)


def routed_params(m: Any) -> int:
    """One sparse block's routed experts (w1, w2, w3 of every expert, gpt-oss's biases b1, b2, b3): what
    expert parallel shards."""
    n, f = int(m.moe.num_experts), expert_dim(m)
    biases = n * (2 * f + m.dim) if getattr(m, "expert_biases", False) else 0
    return 3 * n * m.dim * f + biases


def layer_params(m: Any, layer: int) -> dict[str, int]:
    """One block's parameters: {"routed": routed experts, "other": attention, norms, router, shared / dense FFN}."""
    if not is_sparse(m, layer):
        return {"routed": 0, "other": dense.block_params(m)}
    router = int(m.moe.num_experts) * (m.dim + (1 if getattr(m, "router_bias", False) else 0))
    other = attention_params(m) + router + 3 * m.dim * shared_dim(m)
    return {"routed": routed_params(m), "other": other}


def active_layer_params(m: Any, layer: int) -> int:
    """Parameters one token multiplies in a block: its top-k routed experts, not all of them."""
    p = layer_params(m, layer)
    if not is_sparse(m, layer):
        return p["other"]
    return p["other"] + p["routed"] * int(m.moe.top_k) // int(m.moe.num_experts)


def blocks_params(m: ModelConfig) -> int:
    return sum(sum(layer_params(m, i).values()) for i in range(int(m.n_layers)))


def block_params(m: ModelConfig) -> int:
    """The mean block (the planner sizes a stage as layers x block; exact when every block is sparse)."""
    return round(blocks_params(m) / int(m.n_layers))


def param_count(m: ModelConfig) -> int:
    return dense.embedding_params(m) + dense.head_params(m) + m.dim + blocks_params(m)


def tp_divisors(m: ModelConfig) -> list[tuple[str, int]]:
    """Tensor parallel shards attention, every routed expert's width, the shared experts' and the dense
    blocks' FFN (dtlaunch.models.moe.tp_plan): whole heads per rank, even slices of each width."""
    out = [d for d in dense.tp_divisors(m) if d[0] != "model FFN width"]
    out.append(("model.moe.expert_dim", expert_dim(m)))
    if shared_dim(m):
        out.append(("model.moe.shared_expert_dim", shared_dim(m)))
    if len(sparse_layers(m)) < int(m.n_layers):
        out.append(("model FFN width", ffn_dim(m)))
    return out


# Our module names of a block's linears (model.arch=moe has no Hugging Face format: peft.targets name these).
_OURS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
_OURS_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def block_linears(m: Any, hf: bool = True) -> dict[str, tuple[int, int, bool | None]]:
    """The linears of one sparse block by target name (Hugging Face's, or ours where the family has no HF
    format): (out features, in features, column-parallel under TP; None: whole on every TP rank), in
    forward order: attention, the router's gate (dim -> experts, whole on every TP rank) and the shared
    experts' SwiGLU (column / row-parallel: dtlaunch.models.moe.tp_plan). The routed experts are 3-D parameters, not linears: never adapted,
    frozen in the compute dtype under LoRA / QLoRA (dtlaunch.train.parallel.frozen_base). Blocks that are
    dense (model.moe.sparse_step / dense_layers) are planned as this block (their SwiGLU is not listed)."""
    attn = {k: v for k, v in dense.block_linears(m).items() if k in _OURS}
    out = {(k if hf else _OURS[k]): v for k, v in attn.items()}
    out["gate"] = (int(m.moe.num_experts), int(m.dim), None)
    fs = shared_dim(m)
    if fs:
        shared = {"gate_proj": (fs, m.dim, True), "up_proj": (fs, m.dim, True), "down_proj": (m.dim, fs, False)}
        out.update({(k if hf else _OURS_FFN[k]): v for k, v in shared.items()})
    return out


block_norm_params = dense.block_norm_params
embedding_params = dense.embedding_params
head_params = dense.head_params
head_dim = dense.head_dim
kv_heads = dense.kv_heads
