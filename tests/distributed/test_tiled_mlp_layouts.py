"""Tiled MLP under the parallel layouts: 2-process gloo runs with `training.mlp_tiles=4` against the same
layout untiled (fp32, 3 steps, two accumulation micro-steps): losses and gradient norms within 1e-6
relative. DDP (one gradient accumulation per parameter, so the reducer's hooks fire once), FSDP2 (the
summed gradient on the unsharded parameter), TP without sequence parallel (tiles of the local shard,
w2's output reduced per tile), LoRA and QLoRA adapters in the MLP, and a MoE model's shared experts."""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [
    "model.n_layers=2",
    "training.seq_len=32",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.micro_batch=2",
    "training.global_batch=8",
    "launch.nproc_per_node=2",
]
MLP = "peft.targets=[q_proj,v_proj,gate_proj,up_proj,down_proj]"
LAYOUTS: dict[str, list[str]] = {
    "ddp": ["recipe=tiny_ddp"],
    "fsdp_zero3": ["recipe=tiny_fsdp", "strategy=zero3"],
    "tp": ["recipe=tiny_tp", "training.global_batch=4", "strategy.sequence_parallel=false"],
    "lora_fsdp": ["recipe=tiny_fsdp", "peft=lora", MLP],
    "qlora_ddp": ["recipe=tiny_ddp", "peft=qlora", MLP, "peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"],
    "moe_fsdp": ["recipe=tiny_fsdp", "model=tiny_moe", "model.moe.num_shared_experts=1"],
}


def _tiled_mlps(rt) -> int:
    """MLPs whose forward runs tiled (dtlaunch.train.tiled_mlp replaces it on the instance)."""
    return sum("forward" in vars(m) for m in rt.model_parts[0].modules() if type(m).__name__ == "FeedForward")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    def run_all() -> dict:
        out = {}
        for name, layout in LAYOUTS.items():
            if name.startswith("qlora"):
                pytest.importorskip("torchao")
            out[name] = train([*COMMON, *layout, "training.mlp_tiles=1"], 2, STEPS, inspect=_tiled_mlps)
            out[name + "+tiled"] = train([*COMMON, *layout, "training.mlp_tiles=4"], 2, STEPS, inspect=_tiled_mlps)
        return out

    return run_forked(2, run_all, tmp_path_factory.mktemp("tiled_mlp") / "results.json")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiled_mlp_matches_untiled(name: str, results: dict) -> None:
    plain, tiled = results[name], results[name + "+tiled"]
    assert len(tiled["loss"]) == STEPS
    assert plain["inspect"] == 0 and tiled["inspect"] == 2  # one MLP per block (MoE: the shared experts)
    for a, b in zip(plain["loss"], tiled["loss"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (name, plain, tiled)
    for a, b in zip(plain["grad_norm"], tiled["grad_norm"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (name, plain, tiled)
    assert plain["loss"][-1] < plain["loss"][0]  # the updates moved the loss
