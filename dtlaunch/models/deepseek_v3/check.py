"""DeepSeek-V3's rules on its model section and layout: the MoE decoder's, GLM-4.5's on what config.json
can say (dense blocks first, shared experts n x expert_dim), even RoPE widths, and the layouts its latent
attention has no sharding for (tensor and context parallel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.moe.check import check as moe_check
from dtlaunch.models.moe.shapes import expert_dim

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    moe_check(cfg)
    m = cfg.model
    moe = m.moe
    rope = int(m.qk_rope_head_dim)
    if rope < 2 or rope % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim={rope}: model.arch=deepseek_v3 rotates pairs of dims: set an even number >= 2"
        )
    dense = sorted(int(i) for i in moe.dense_layers)
    if dense != list(range(len(dense))) or int(moe.sparse_step) != 1:
        raise ConfigError(
            f"model.moe.dense_layers={dense} with model.moe.sparse_step={moe.sparse_step}: model.arch=deepseek_v3 "
            f"has its dense blocks first (first_k_dense_replace): list 0..k-1 and keep sparse_step=1"
        )
    shared = moe.shared_expert_dim
    if shared is not None and int(shared) != int(moe.num_shared_experts) * expert_dim(m):
        raise ConfigError(
            f"model.moe.shared_expert_dim={shared}: model.arch=deepseek_v3's shared experts are "
            f"num_shared_experts x expert_dim wide: drop it (null)"
        )
    for key in ("tp", "cp"):
        degree = int(getattr(cfg.strategy, key, 1) or 1)
        if degree > 1:
            raise ConfigError(
                f"strategy.{key}={degree}: model.arch=deepseek_v3's latent attention is not sharded by "
                f"{'tensor' if key == 'tp' else 'context'} parallel: set strategy.{key}=1 (use fsdp / ep)"
            )
