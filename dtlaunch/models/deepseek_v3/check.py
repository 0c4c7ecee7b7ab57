"""DeepSeek-V3's rules on its model section and layout: the MoE decoder's, GLM-4.5's on what config.json
can say (dense blocks first, shared experts n x expert_dim), even RoPE widths, and the layouts its latent
attention has no sharding for (tensor and context parallel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.glm4_moe.check import check_config_json_moe
from dtlaunch.models.moe.check import check as moe_check

if TYPE_CHECKING:
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
    from dtlaunch.config.layout import Layout, world_size

    # The resolved degrees: strategy=tp's tp=-1 means every rank.
    layout = Layout.resolve(cfg.strategy, world_size(cfg))
    for key in ("tp", "cp"):
        degree = int(getattr(layout, key))
        if degree > 1:
            raise ConfigError(
                f"strategy.{key}={degree}: model.arch=deepseek_v3's latent attention is not sharded by "
                f"{'tensor' if key == 'tp' else 'context'} parallel: set strategy.{key}=1 (use fsdp / ep)"
            )
