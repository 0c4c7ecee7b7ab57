"""The MoE decoder's own rules on a model section: the dense attention's, plus experts that exist, top_k
within them and dense layers inside the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.check import check_attention, check_window

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    m = cfg.model
    check_attention(m)
    check_window(cfg)
    moe, n = m.moe, int(m.moe.num_experts)
    if n < 1:
        raise ConfigError(
            f"model.moe.num_experts={n}: model.arch={m.arch} is a mixture of experts: set model.moe.num_experts, e.g. 8"
        )
    if int(moe.top_k) > n:
        raise ConfigError(f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={n}: set model.moe.top_k <= {n}")
    bad = [i for i in moe.dense_layers if int(i) >= int(m.n_layers)]
    if bad:
        raise ConfigError(
            f"model.moe.dense_layers has {bad[0]}, past the last block (model.n_layers={m.n_layers}): "
            f"list block indices below {m.n_layers}"
        )
    check_groups(m)


def check_groups(m: Any) -> None:
    """Group-limited routing (model.moe.n_group > 1): equal groups of at least two experts (a group is
    scored by its two best), topk_group of them, holding at least top_k experts."""
    moe, n = m.moe, int(m.moe.num_experts)
    groups, keep = int(moe.n_group), int(moe.topk_group)
    if groups == 1:
        return
    if n % groups or n // groups < 2:
        raise ConfigError(
            f"model.moe.n_group={groups} does not split model.moe.num_experts={n} into equal groups of >= 2 "
            f"experts (model.arch={m.arch} scores a group by its best two): pick a divisor of {n} up to {n // 2}"
        )
    if keep > groups or keep * (n // groups) < int(moe.top_k):
        raise ConfigError(
            f"model.moe.topk_group={keep} does not fit model.arch={m.arch}'s routing: keep at most "
            f"model.moe.n_group={groups} groups, enough for model.moe.top_k={moe.top_k} experts ({n // groups} per group)"
        )
