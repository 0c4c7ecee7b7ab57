"""Qwen3.5's config.json <-> the model section: Qwen3-Next's hybrid keys (dtlaunch/models/qwen3_next/hf.py)
over the dense decoder (qwen3_5) or Qwen3-Next's MoE keys (qwen3_5_moe: every block sparse, top-k weights
always renormalised, so no norm_topk_prob / decoder_sparse_step / mlp_only_layers, and no dense
intermediate_size).

Published checkpoints are Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration: their
config.json nests the text decoder's keys in `text_config` beside a `vision_config`. Import reads the text
decoder only (the vision tower is skipped: names.py), tied as the top level's tie_word_embeddings says (the
key the multimodal model ties by). A text-only Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM directory has
those keys at the top. Export writes that text-only Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM.

RoPE is Qwen3-VL's text rotary: three position streams (time, height, width) whose frequencies interleave
by `mrope_section`. Text has the same position in all three, so it is 1-D partial RoPE, and the section
(no field here) is left to transformers' default on export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlaunch.models.qwen3_next.hf import GatedDeltaNetHF, Qwen3NextHF

# The keys of Qwen3-Next's config.json that Qwen3.5-MoE's has not (transformers' Qwen3_5MoeTextConfig).
_NOT_MOE = ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def text_config(c: dict) -> dict:
    """The text decoder's keys: a multimodal config.json's `text_config` (with its top-level tying), or `c`.
    A rope_scaling that only carries the multimodal sections (rope_type default) scales nothing: dropped."""
    text = c.get("text_config")
    if isinstance(text, dict):
        c = {**text, "tie_word_embeddings": bool(c.get("tie_word_embeddings", False))}
    scaling = c.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        c = {**c, "rope_scaling": None}
    return c


def source_note(c: dict) -> str:
    """What `describe_hf_source` adds for a directory: a multimodal checkpoint loads its text decoder only."""
    return "; its text decoder only (the vision tower, model.visual.*, is skipped)" if "text_config" in c else ""


@dataclass(frozen=True)
class Qwen3_5HF(GatedDeltaNetHF):
    def config_from_hf(self, c: dict, where: str) -> dict:
        return super().config_from_hf(text_config(c), where)

    def source_note(self, c: dict) -> str:
        return source_note(c)


@dataclass(frozen=True)
class Qwen3_5MoeHF(Qwen3NextHF):
    def config_to_hf(self, m: Any, dtype: str = "float32") -> dict:
        out = super().config_to_hf(m, dtype)
        return {k: v for k, v in out.items() if k not in _NOT_MOE}

    def config_from_hf(self, c: dict, where: str) -> dict:
        c = text_config(c)
        # The dense decoder's ffn_dim, which no block of an all-sparse model uses, as the experts' width.
        return super().config_from_hf({**c, "intermediate_size": c["moe_intermediate_size"]}, where)

    def source_note(self, c: dict) -> str:
        return source_note(c)
