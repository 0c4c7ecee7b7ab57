"""What `validate` refuses for peft=qlora, each in one line that names the key, the value and the fix."""

from __future__ import annotations

import pytest

from dtlaunch.config.compose import compose
from dtlaunch.config.validate import validate
from dtlaunch.errors import ConfigError

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
