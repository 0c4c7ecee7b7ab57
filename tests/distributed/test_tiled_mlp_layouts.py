"""Tiled MLP under the parallel layouts: 2-process gloo runs with `training.mlp_tiles=4` against the same
layout untiled (fp32, 3 steps, two accumulation micro-steps): losses and gradient norms within 1e-6
relative. DDP (one gradient accumulation per parameter, so the reducer's hooks fire once), FSDP2 (the
summed gradient on the unsharded parameter), TP without sequence parallel (tiles of the local shard,
w2's output reduced per tile), LoRA and QLoRA adapters in the MLP, and a MoE model's shared and routed
experts (the routed ones over tiles of their permuted rows) under FSDP2 and expert parallel."""

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
    "moe_ep": ["recipe=tiny_fsdp", "strategy=zero3", "model=tiny_moe", "strategy.ep=2"],
}


def _tiled_mlps(rt) -> list[int]:
    """Dense MLPs and routed experts whose forward runs tiled (dtlaunch.train.features.tiled_mlp replaces it on the
    instance). By class name through the MRO: FSDP2 sharding a module on its own (the experts under EP)
    makes its class a subclass."""
    mods = [(m, {c.__name__ for c in type(m).__mro__}) for m in rt.model_parts[0].modules()]
    return [sum("forward" in vars(m) for m, names in mods if k in names) for k in ("FeedForward", "GroupedExperts")]


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
    # One MLP per block (MoE: the shared experts, none in moe_ep), and a MoE block's routed experts.
    mlps, routed = (0 if name == "moe_ep" else 2), (2 if name.startswith("moe") else 0)
    assert plain["inspect"] == [0, 0] and tiled["inspect"] == [mlps, routed]
    for a, b in zip(plain["loss"], tiled["loss"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (name, plain, tiled)
    for a, b in zip(plain["grad_norm"], tiled["grad_norm"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (name, plain, tiled)
    assert plain["loss"][-1] < plain["loss"][0]  # the updates moved the loss
