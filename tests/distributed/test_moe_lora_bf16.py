"""LoRA on the tiny MoE model in bf16: the frozen routed experts are stored in bf16 on every layout (one
process with autocast, FSDP2, FSDP2 x expert parallel), and two gloo workers train as one process does.

One process autocasts (its bf16 experts meet the fp32 activations in the grouped GEMM / the per-expert
loop); FSDP2 computes in bf16 (MixedPrecisionPolicy). Loss and grad norm agree within bf16's sums in
another order (QLoRA's layout tolerance, tests/distributed/test_qlora.py).
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

TOL = 5e-3
STEPS = 3
COMMON = [
    "model=tiny_moe",
    "peft=lora",
    "peft.targets=[wq,wk,wv,wo]",
    "precision=bf16",
    "training.seq_len=32",
    "optim.warmup_steps=1",
    "optim.lr=2e-2",
]
LAYOUTS = {
    "zero3": ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"],
    "zero3_ep2": ["recipe=tiny_fsdp", "strategy=zero3", "strategy.ep=2", "training.micro_batch=4"],
}


def expert_dtypes(rt) -> list[str]:
    """The stored dtype of every routed-expert weight (its local shard under FSDP / EP)."""
    from dtlaunch.models.local_tensor import local_tensor
    from dtlaunch.models.moe.experts import GroupedExperts

    return sorted(
        {
            str(local_tensor(p).dtype)
            for part in rt.model_parts
            for m in part.modules()
            if isinstance(m, GroupedExperts)
            for p in (m.w1, m.w2, m.w3)
        }
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {
            n: train([*COMMON, *ov, "launch.nproc_per_node=2"], 2, STEPS, expert_dtypes) for n, ov in LAYOUTS.items()
        }

    return run_forked(2, run_all, tmp_path_factory.mktemp("moe_lora_bf16") / "results.json")


@pytest.fixture(scope="module")
def reference() -> dict:
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    over = [*COMMON, "recipe=tiny_fsdp", "training.micro_batch=8", "launch.nproc_per_node=1"]
    return train(over, 1, STEPS, expert_dtypes, convert=lambda model, cfg: convert_frozen_base(model, cfg, 1))


def test_one_process_stores_bf16_experts(reference) -> None:
    assert reference["inspect"] == ["torch.bfloat16"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_moe_lora_parity(name: str, launched, reference) -> None:
    got = launched[name]
    assert got["inspect"] == ["torch.bfloat16"], got["inspect"]
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], reference[key], strict=True))
        assert diff <= TOL, f"{name} {key}: max |diff| {diff:.2e}\n{got[key]}\n{reference[key]}"
