"""What `validate` refuses for peft=qlora, each in one line that names the key, the value and the fix."""

from __future__ import annotations

import json

import pytest

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate

BASE = ["model=tiny", "peft=qlora", "precision=bf16", "launch.nproc_per_node=2"]
SMALL_BLOCKS = ["peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=tp"], r"peft.method=qlora with strategy.tp=2: .* set strategy.tp=1"),
        (["strategy=pp", "model.n_layers=2"], r"peft.method=qlora with strategy.pp=2: .* set strategy.pp=1"),
        # The tiny model's 64x64 query projection in 2 row shards: 2,048 elements, not 64 x 256.
        (["strategy=zero3"], r"layers.0.attention.wq.weight 64x64 in 2 row shard\(s\) .*nf4_block_size=64"),
        (["strategy=ddp", "peft.nf4_block_size=48"], r"peft.nf4_block_size=48 x peft.nf4_scaler_block_size=256"),
    ],
)
def test_qlora_layouts_that_cannot_hold_nf4_are_refused(overrides: list[str], message: str) -> None:
    cfg = compose([*BASE, *overrides]).cfg
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "zero2", "zero1"])
def test_qlora_on_ddp_and_fsdp_with_fitting_blocks_is_valid(strategy: str) -> None:
    validate(compose([*BASE, *SMALL_BLOCKS, f"strategy={strategy}"]).cfg)


def _hybrid_dir(name: str, tiny_hf_dirs, tiny_moe_hf_dirs):
    return (tiny_hf_dirs if name == "qwen3_5" else tiny_moe_hf_dirs)[name]


@pytest.mark.parametrize(
    "name,weight",
    [
        ("qwen3_next", r"in_proj_qkvz.weight 128x64"),
        ("qwen3_5", r"in_proj_qkv.weight 96x64"),
        ("qwen3_5_moe", r"in_proj_qkv.weight 96x64"),
    ],
)
def test_qlora_on_the_gated_deltanet_hybrids(name: str, weight: str, tiny_hf_dirs, tiny_moe_hf_dirs) -> None:
    """The tiny hybrids' Gated DeltaNet projections hold no whole 64 x 256 blocks (refused, naming the weight);
    16 x 4 blocks fit on one process and in FSDP2's 2 row shards, the shared expert's one-row gate left out
    of NF4 (dtlaunch.models.nf4.frozen_block_linears)."""
    hybrid = ["model=tiny", f"model.init_from=hf:{_hybrid_dir(name, tiny_hf_dirs, tiny_moe_hf_dirs)}"]
    hybrid += ["peft=qlora", "precision=bf16", "training.seq_len=16"]
    with pytest.raises(ConfigError, match=rf"^peft.method=qlora: layers.0.attention.{weight}"):
        validate(compose([*hybrid, "launch.nproc_per_node=1"]).cfg)
    validate(compose([*hybrid, *SMALL_BLOCKS, "launch.nproc_per_node=1"]).cfg)
    for strategy in ("zero3", "ddp"):
        validate(compose([*hybrid, *SMALL_BLOCKS, f"strategy={strategy}", "launch.nproc_per_node=2"]).cfg)


def test_published_qwen3_next_holds_nf4_blocks_in_fsdp_row_shards() -> None:
    """Qwen3-Next-80B-A3B's linears (4 of its 48 blocks, on meta) at the default 64 x 256 NF4 blocks: whole in
    up to 8 FSDP row shards (its shared-expert gate, one row, is not quantised), and past that in_proj_ba's 64
    rows are the first refused, naming the sizes that fit."""
    transformers = pytest.importorskip("transformers")
    from hf_loaded import QWEN3_NEXT_80B_A3B

    from dtlaunch.models.lora import apply_lora
    from dtlaunch.models.nf4 import nf4_blocks_problem
    from dtlaunch.models.qwen3_next.hf import Qwen3NextHF
    from dtlaunch.models.registry import meta_model, model_spec

    config = transformers.Qwen3NextConfig(**{**QWEN3_NEXT_80B_A3B, "num_hidden_layers": 4})
    fields = Qwen3NextHF("Qwen3NextForCausalLM", "qwen3_next", qk_norm=True).config_from_hf(config.to_dict(), "x")
    moe = fields.pop("moe")
    over = [f"model.{k}={json.dumps(v)}" for k, v in fields.items() if k != "arch"]
    over += [f"model.moe.{k}={json.dumps(v)}" for k, v in moe.items()]
    cfg = compose(["model=tiny", "model.arch=qwen3_next", *over, "peft=qlora"]).cfg
    model = meta_model(cfg.model)
    apply_lora(model, model_spec(cfg.model), cfg.peft)
    assert all(nf4_blocks_problem(model, 64, 256, shards) == "" for shards in (1, 2, 4, 8))
    assert nf4_blocks_problem(model, 64, 256, 16).startswith("layers.0.attention.in_proj_ba.weight 64x2048 in 16")
