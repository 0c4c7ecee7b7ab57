"""gpt-oss's rules on its model section, on top of the MoE decoder's: layer_types as OLMo 3 / Gemma 3 give
them, and no context parallel (the attention sinks' softmax is the decoder's own eager attention, which
ring / Ulysses attention cannot replace)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.moe.check import check as moe_check
from dtlaunch.models.olmo3.check import check_layer_types

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    m, cp = cfg.model, int(cfg.strategy.cp)
    if cp > 1 and m.attention_sinks:
        raise ConfigError(
            f"strategy.cp={cp}: model.arch=gpt_oss adds attention sinks to every softmax, which context parallel's "
            f"ring / Ulysses attention does not: set strategy.cp=1"
        )
    if bool(m.qkv_bias) != bool(m.attention_out_bias):
        raise ConfigError(
            f"model.attention_out_bias={m.attention_out_bias} with model.qkv_bias={m.qkv_bias}: gpt-oss's one "
            f"attention_bias covers q, k, v and o: set both to the same value"
        )
    moe_check(cfg)
    check_layer_types(m)
    if m.rope_scaling is not None:
        raise ConfigError(
            "model.rope_scaling is Llama 3.1's, not gpt-oss's: remove it (model.rope_yarn scales gpt-oss's RoPE)"
        )
