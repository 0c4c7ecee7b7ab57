"""The MoE decoder <-> Hugging Face (Qwen3-MoE, Mixtral): tensor names and config.json. Pure Python apart
from reshaping the tensors it is handed (no torch import).

Hugging Face checkpoints hold one 2-D tensor per expert and projection (transformers 5 fuses them into
3-D parameters when it loads and splits them again when it saves); ours are 3-D, expert first. So
`experts.w1` [E, hidden, dim] is written as E tensors `...experts.<e>.<gate name>.weight`, and read
back by stacking them (dtlaunch.convert.hf.HFWeights reads a rank's experts and rows only). Attention,
norms and the RoPE row permutation are the dense decoder's (dtlaunch/models/dense/hf.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.errors import InputError
from dtlaunch.models.dense import hf as dense
from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.moe.shapes import expert_dim

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig

_EXPERT = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")


@dataclass(frozen=True)
class MoENames:
    """One family's names for the sparse FFN: its module prefix and its names of w1 / w2 / w3."""

    prefix: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    w1: str
    w2: str
    w3: str

    def _proj(self, ours: str) -> str:
        return {"w1": self.w1, "w2": self.w2, "w3": self.w3}[ours]

    def to_hf_name(self, name: str, expert: int = 0) -> str:
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.router\.gate\.weight", name)
        if m:
            return f"model.layers.{m.group(1)}.{self.prefix}.gate.weight"
        m = _EXPERT.fullmatch(name)
        if m:
            return f"model.layers.{m.group(1)}.{self.prefix}.experts.{expert}.{self._proj(m.group(2))}.weight"
        return dense.to_hf_name(name)

    def expert_slot(self, hf_name: str) -> Optional[tuple[str, int]]:
        """(our stacked parameter, expert index) for one expert's HF tensor; None for the others."""
        m = re.fullmatch(rf"model\.layers\.(\d+)\.{self.prefix}\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if not m:
            return None
        ours = {self.w1: "w1", self.w2: "w2", self.w3: "w3"}.get(m.group(3))
        if ours is None:
            raise InputError(f"unexpected tensor {hf_name}: this architecture has no such parameter")
        return f"layers.{m.group(1)}.feed_forward.experts.{ours}", int(m.group(2))

    def from_hf_name(self, name: str) -> str:
        m = re.fullmatch(rf"model\.layers\.(\d+)\.{self.prefix}\.gate\.weight", name)
        if m:
            return f"layers.{m.group(1)}.feed_forward.router.gate.weight"
        slot = self.expert_slot(name)
        if slot:
            return slot[0]
        return dense.from_hf_name(name)

    def to_hf_state(self, state: dict, m: ModelConfig) -> dict:
        """Ours -> HF: stacked experts split per expert, attention in HF's RoPE layout."""
        out, plain = {}, {}
        for name, t in state.items():
            if name.endswith("router.expert_bias"):
                if bool((t != 0).any()):
                    raise InputError(
                        f"{name}: the auxiliary-loss-free routing bias (model.moe.bias_update_rate > 0) has no "
                        f"place in the Hugging Face format of model.arch={m.arch}: export with --format torch"
                    )
                continue
            if _EXPERT.fullmatch(name):
                for e in range(t.shape[0]):
                    out[self.to_hf_name(name, e)] = t[e].contiguous()
            elif name.endswith("router.gate.weight"):
                out[self.to_hf_name(name)] = t.contiguous()
            else:
                plain[name] = t
        out.update(dense.to_hf_state(plain, m))
        return out

    def from_hf_state(self, state: dict, m: Any) -> dict:
        import torch

        experts: dict[str, dict[int, Any]] = {}
        out, rest = {}, {}
        for hf_name, t in state.items():
            slot = self.expert_slot(hf_name)
            if slot:
                experts.setdefault(slot[0], {})[slot[1]] = t
            elif re.fullmatch(rf"model\.layers\.\d+\.{self.prefix}\.gate\.weight", hf_name):
                out[self.from_hf_name(hf_name)] = t.contiguous()
            else:
                rest[hf_name] = t
        out.update(dense.from_hf_state(rest, m))
        for name, per in experts.items():
            out[name] = torch.stack([per[e] for e in sorted(per)]).contiguous()
        return out


@dataclass(frozen=True)
class MoEHF(DenseHF):
    """config.json of a MoE family: the dense keys plus its expert keys."""

    experts_key: str = "num_experts"  # Qwen3-MoE; Mixtral: num_local_experts
    expert_dim_key: str = ""  # Qwen3-MoE: moe_intermediate_size; Mixtral: intermediate_size itself

    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        moe = m.moe
        out[self.experts_key] = out["num_local_experts"] = int(moe.num_experts)
        out["num_experts_per_tok"] = int(moe.top_k)
        out["router_aux_loss_coef"] = float(moe.aux_loss_coef)
        out["output_router_logits"] = False
        if self.expert_dim_key:
            out[self.expert_dim_key] = expert_dim(m)
            out["norm_topk_prob"] = bool(moe.norm_topk)
            out["decoder_sparse_step"] = int(moe.sparse_step)
            out["mlp_only_layers"] = sorted(int(i) for i in moe.dense_layers)
        else:
            out["intermediate_size"] = expert_dim(m)
        return out

    def config_from_hf(self, c: dict, where: str) -> dict:
        out = super().config_from_hf(c, where)
        # transformers 5 writes num_local_experts for every family (4.x: num_experts for Qwen3-MoE).
        n = int(c.get(self.experts_key) or c.get("num_local_experts") or 0)
        if n < 1:
            raise InputError(
                f"{where}: config.json sets no {self.experts_key}: it does not describe a mixture of experts"
            )
        moe: dict[str, Any] = {
            "num_experts": n,
            "top_k": int(c.get("num_experts_per_tok", 2)),
            "aux_loss_coef": float(c.get("router_aux_loss_coef") or 0.0) if c.get("output_router_logits") else 0.0,
            "norm_topk": True,
        }
        if self.expert_dim_key:
            moe["expert_dim"] = int(c[self.expert_dim_key])
            moe["norm_topk"] = bool(c.get("norm_topk_prob", False))
            moe["sparse_step"] = int(c.get("decoder_sparse_step", 1))
            moe["dense_layers"] = [int(i) for i in c.get("mlp_only_layers") or []]
            if c.get("shared_expert_intermediate_size"):
                raise InputError(f"{where}: shared experts are not part of {self.architecture}: use model.arch=hf_auto")
        out["moe"] = moe
        return out


_QWEN_EXPERTS = MoENames("mlp", w1="gate_proj", w2="down_proj", w3="up_proj")


class QwenExpertsNames:
    """A names module's functions for a MoE family whose routed experts and router are named as Qwen3-MoE's
    (`mlp.experts.<e>.{gate,up,down}_proj`, `mlp.gate`), whose other block tensors `renames` maps (ours ->
    HF under layers.N.; the rest are the dense decoder's names), with the family's `rope_heads` (the q/k rows
    it permutes) and `skip_hf` (HF tensors it does not read): GLM-4.5, DeepSeek-V3, Qwen3-Next."""

    def __init__(self, renames: dict[str, str], rope_heads: Any, skip_hf: Any) -> None:
        self.renames, self.from_hf = dict(renames), {v: k for k, v in renames.items()}
        self.rope_heads, self.skip_hf = rope_heads, skip_hf
        self.expert_slot = _QWEN_EXPERTS.expert_slot

    @staticmethod
    def routed(name: str) -> bool:
        """A routed expert's stacked tensor or the router's gate (ours)."""
        return bool(re.fullmatch(r"layers\.\d+\.feed_forward\.(experts\.w[123]|router\.gate\.weight)", name))

    def routed_hf(self, name: str) -> bool:
        return bool(self.expert_slot(name) or re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", name))

    def to_hf_name(self, name: str, expert: int = 0) -> str:
        if self.routed(name):
            return _QWEN_EXPERTS.to_hf_name(name, expert)
        return dense.renamed_to_hf(name, self.renames)

    def from_hf_name(self, name: str) -> str:
        if self.routed_hf(name):
            return _QWEN_EXPERTS.from_hf_name(name)
        return dense.renamed_from_hf(name, self.from_hf)

    def to_hf_state(self, state: dict, m: Any) -> dict:
        """Ours -> HF: routed experts split per expert, the rest by name (a tied head written once)."""
        out = _QWEN_EXPERTS.to_hf_state({n: t for n, t in state.items() if self.routed(n)}, m)
        rest = {n: t for n, t in state.items() if not self.routed(n)}
        out.update(dense.to_hf_state(rest, m, self.to_hf_name, self.rope_heads))
        return out

    def from_hf_state(self, state: dict, m: Any) -> dict:
        state = {n: t for n, t in state.items() if not self.skip_hf(n, m)}
        theirs = {n: t for n, t in state.items() if self.routed_hf(n)}
        out = _QWEN_EXPERTS.from_hf_state(theirs, m)
        rest = {n: t for n, t in state.items() if n not in theirs}
        out.update(dense.from_hf_state(rest, m, self.from_hf_name, self.rope_heads))
        return out
