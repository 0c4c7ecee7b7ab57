"""DeepSeek-V3's rules on its model section and layout: the MoE decoder's, GLM-4.5's on what config.json
can say (dense blocks first, shared experts n x expert_dim), even RoPE widths, whole heads per tensor-parallel
rank, and context parallel, which its latent attention has no sharding for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.glm4_moe.check import check_config_json_moe
from dtlaunch.models.moe.check import check as moe_check

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    moe_check(cfg)
    m = cfg.model
    rope = int(m.qk_rope_head_dim)
    if rope < 2 or rope % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim={rope}: model.arch=deepseek_v3 rotates pairs of dims: set an even number >= 2"
        )
    check_config_json_moe(cfg, "deepseek_v3")


def check_layout(cfg: JobConfig, d: Decisions) -> None:
    """On the resolved layout (strategy=tp's tp=-1 means every rank)."""
    layout, heads = d.layout, int(cfg.model.n_heads)
    if layout.tp > 1 and heads % layout.tp:
        raise ConfigError(
            f"model.n_heads={heads} (num_attention_heads) is not divisible by strategy.tp={layout.tp}: "
            f"model.arch=deepseek_v3's latent attention gives each tensor-parallel rank whole heads: "
            f"pick a tp that divides {heads}"
        )
    if layout.cp > 1:
        raise ConfigError(
            f"strategy.cp={layout.cp}: model.arch=deepseek_v3's latent attention is not sharded by context "
            "parallel: set strategy.cp=1 (use fsdp / ep)"
        )
