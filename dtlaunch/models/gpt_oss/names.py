"""gpt-oss's tensor names (Hugging Face <-> ours). Attention and norms are the dense decoder's names and
RoPE rows (models/dense/hf.py) plus the output bias and the sinks; the router is `mlp.router` (weight and
bias). HF keeps each layer's experts fused, as transformers' GptOssExperts holds them:
`mlp.experts.gate_up_proj` [E, dim, 2F] with gate and up in alternating columns (gate at even ones) and
`mlp.experts.down_proj` [E, F, dim], each with a bias ([E, 2F], [E, dim]). Ours are the MoE decoder's
`experts.w1` / `w3` [E, F, dim], `w2` [E, dim, F] and biases `b1` / `b3` [E, F], `b2` [E, dim]: one HF
tensor gives two of ours (`hf_parts`, which the importer also uses to read a rank's experts only), and
both directions are exact copies (a permutation of entries). Published MXFP4 experts are dequantized on
import (models/gpt_oss/mxfp4.py)."""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from dtlaunch.models.dense import hf as dense
from dtlaunch.models.dense.hf import rope_heads  # noqa: F401 (the names module's RoPE rows: HFWeights reads it)
from dtlaunch.models.gpt_oss import mxfp4

# Ours -> HF under layers.N., where gpt-oss differs from (or adds to) the dense decoder's names.
_BLOCK = {
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    "feed_forward.experts.w1": "mlp.experts.gate_up_proj",
    "feed_forward.experts.w3": "mlp.experts.gate_up_proj",
    "feed_forward.experts.b1": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.b3": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
_FROM_HF = {v: k for k, v in _BLOCK.items() if not k.endswith(("w1", "w3", "b1", "b3"))}
_EXPERT_HF = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)(_blocks|_scales)?"
)


def to_hf_name(name: str) -> str:
    return dense.renamed_to_hf(name, _BLOCK)


def from_hf_name(name: str) -> str:
    return dense.renamed_from_hf(name, _FROM_HF)


# The fused gate_up tensor's gate and up outputs alternate (gate at even columns): a LoRA B of the fused
# tensor interleaves its rows the same way (dtlaunch.convert.adapters).
GATE_UP_INTERLEAVED = True


def _gate(t: Any) -> Any:
    return t[..., 0::2]


def _up(t: Any) -> Any:
    return t[..., 1::2]


def _transposed(t: Any) -> Any:
    return t.transpose(-2, -1)


def _same(t: Any) -> Any:
    return t


def hf_parts(hf_name: str) -> Optional[dict[str, Callable[..., Any]]]:
    """Our tensors held in one fused HF expert tensor, each with the function taking that tensor (or a
    block of its leading expert rows) to ours; None for a tensor that is not an expert tensor. MXFP4
    weights (published checkpoints): the function of `..._blocks` also takes its `hf_companions`, the
    scales (read with the same expert rows), and dequantizes; the scales themselves give none of ours ({})."""
    m = _EXPERT_HF.fullmatch(hf_name)
    if not m:
        return None
    layer, kind, packed = f"layers.{m.group(1)}.feed_forward.experts", m.group(2), m.group(3)
    if packed and kind not in ("gate_up_proj", "down_proj"):
        return None  # biases are never packed
    if packed == mxfp4.SCALES:
        return {}
    if packed == mxfp4.BLOCKS:
        plain = hf_parts(hf_name.removesuffix(mxfp4.BLOCKS)) or {}
        return {ours: _after_dequantizing(take) for ours, take in plain.items()}
    if kind == "gate_up_proj":
        return {f"{layer}.w1": lambda t: _transposed(_gate(t)), f"{layer}.w3": lambda t: _transposed(_up(t))}
    if kind == "gate_up_proj_bias":
        return {f"{layer}.b1": _gate, f"{layer}.b3": _up}
    if kind == "down_proj":
        return {f"{layer}.w2": _transposed}
    return {f"{layer}.b2": _same}


def _after_dequantizing(take: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda blocks, scales: take(mxfp4.dequantized(blocks, scales))


def hf_companions(hf_name: str) -> tuple[str, ...]:
    """The other HF tensors `hf_parts(hf_name)`'s functions read (an MXFP4 tensor's scales)."""
    m = _EXPERT_HF.fullmatch(hf_name)
    if m and m.group(3) == mxfp4.BLOCKS:
        return (hf_name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES,)
    return ()


def _interleave(gate: Any, up: Any) -> Any:
    """[..., F] gate and up -> [..., 2F], gate in the even columns."""
    import torch

    return torch.stack([gate, up], dim=-1).flatten(-2)


def to_hf_state(state: dict, m: Any) -> dict:
    """Ours -> HF: experts fused back (gate and up interleaved, transposed to [in, out]), the rest renamed
    with the dense decoder's RoPE layout."""
    out, plain, experts = {}, {}, {}
    for name, t in state.items():
        hit = re.fullmatch(r"(layers\.\d+\.feed_forward\.experts)\.([wb][123])", name)
        if hit:
            experts.setdefault(hit.group(1), {})[hit.group(2)] = t
        else:
            plain[name] = t
    for prefix, e in experts.items():
        hf = to_hf_name(f"{prefix}.w1").removesuffix(".gate_up_proj")
        out[f"{hf}.gate_up_proj"] = _interleave(_transposed(e["w1"]), _transposed(e["w3"])).contiguous()
        out[f"{hf}.down_proj"] = _transposed(e["w2"]).contiguous()
        if "b1" in e:
            out[f"{hf}.gate_up_proj_bias"] = _interleave(e["b1"], e["b3"]).contiguous()
            out[f"{hf}.down_proj_bias"] = e["b2"].contiguous()
    out.update(dense.to_hf_state(plain, m, to_hf_name, rope_heads))
    return out


def from_hf_state(state: dict, m: Any) -> dict:
    out, rest = {}, {}
    for hf_name, t in state.items():
        parts = hf_parts(hf_name)
        if parts is None:
            rest[hf_name] = t
            continue
        companions = [state[c] for c in hf_companions(hf_name)]
        for ours, take in parts.items():
            out[ours] = take(t, *companions).contiguous()
    out.update(dense.from_hf_state(rest, m, from_hf_name, rope_heads))
    return out
