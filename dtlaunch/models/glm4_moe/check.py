"""GLM-4.5's rules on its model section: the MoE decoder's, plus what its config.json can say (dense
blocks first, shared experts n x expert_dim) and a rotary width RoPE can rotate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.shapes import head_dim, rotary_dim
from dtlaunch.models.moe.check import check as moe_check
from dtlaunch.models.moe.shapes import expert_dim

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    moe_check(cfg)
    m = cfg.model
    r = rotary_dim(m)
    if r < 2 or r % 2:
        raise ConfigError(
            f"model.partial_rotary_factor={m.partial_rotary_factor} rotates {r} of head_dim={head_dim(m)} dims: "
            f"model.arch=glm4_moe needs an even number >= 2, pick a factor giving one"
        )
    check_config_json_moe(cfg, "glm4_moe")


def check_config_json_moe(cfg: JobConfig, arch: str) -> None:
    """What a GLM-4.5 / DeepSeek-V3 config.json can say of its experts: dense blocks first
    (first_k_dense_replace) and shared experts num_shared_experts x expert_dim wide."""
    m = cfg.model
    moe = m.moe
    dense = sorted(int(i) for i in moe.dense_layers)
    if dense != list(range(len(dense))) or int(moe.sparse_step) != 1:
        raise ConfigError(
            f"model.moe.dense_layers={dense} with model.moe.sparse_step={moe.sparse_step}: model.arch={arch} has "
            f"its dense blocks first (first_k_dense_replace): list 0..k-1 and keep sparse_step=1"
        )
    shared = moe.shared_expert_dim
    if shared is not None and int(shared) != int(moe.num_shared_experts) * expert_dim(m):
        raise ConfigError(
            f"model.moe.shared_expert_dim={shared}: model.arch={arch}'s shared experts are "
            f"num_shared_experts x expert_dim wide: drop it (null)"
        )
