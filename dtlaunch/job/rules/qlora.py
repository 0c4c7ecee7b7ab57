"""Rules for `peft.method=qlora` that need the layout, run by `validate` before any worker starts.

The NF4 base (torchao) is sharded by FSDP2 along rows and replicated by DDP; tensor parallel would cut
NF4 weights into column shards and pipeline / expert parallel move or split modules in ways the NF4
tensor's dispatch does not cover, so those layouts are refused. Every frozen block linear must split into
whole NF4 blocks: each FSDP row shard holds `nf4_block_size x nf4_scaler_block_size`-element groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.layout import Layout
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def fsdp_shards(cfg: JobConfig, layout: Layout) -> int:
    """Ranks one FSDP2 unit's parameters are cut into (1 without FSDP): the shard dim of the data mesh,
    or its one dim when only replicas or only shards exist (dtlaunch.train.parallel.mesh.dp_mesh)."""
    if int(cfg.strategy.zero_stage) < 2:
        return 1
    if layout.dp_replicate > 1 and layout.shard > 1:
        return layout.shard
    return layout.dp_replicate * layout.shard


def check_qlora(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    if str(cfg.peft.method) != "qlora":
        return
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "peft.method=qlora needs the 'torchao' package (its NF4 tensor): pip install 'dtlaunch[qlora]'"
        )
    for dim, value, fix in (
        ("strategy.tp", layout.tp, "strategy.tp=1 (FSDP2 or DDP)"),
        ("strategy.pp", layout.pp, "strategy.pp=1 (FSDP2 or DDP)"),
        ("strategy.ep", layout.ep, "strategy.ep=1"),
    ):
        if value > 1:
            raise ConfigError(
                f"peft.method=qlora with {dim}={value}: the NF4 base is sharded by FSDP2 or replicated by DDP "
                f"only; set {fix}, or use peft=lora"
            )
    check_nf4_blocks(cfg, fsdp_shards(cfg, layout))


def check_nf4_blocks(cfg: JobConfig, shards: int) -> None:
    """Every frozen block linear, cut into `shards` row shards, holds whole NF4 blocks (shapes from the
    model built on the meta device with its adapters)."""
    from dtlaunch.models.lora import apply_lora
    from dtlaunch.models.nf4 import nf4_blocks_problem
    from dtlaunch.models.registry import meta_model, model_spec

    p = cfg.peft
    block, scaler = int(p.nf4_block_size), int(p.nf4_scaler_block_size)
    spec = model_spec(cfg.model)
    model = meta_model(cfg.model)
    apply_lora(model, spec, p)
    problem = nf4_blocks_problem(model, block, scaler, shards)
    if problem:
        raise ConfigError(f"peft.method=qlora: {problem}")
