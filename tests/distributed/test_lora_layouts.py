"""LoRA loss parity of every parallel layout with one process, in two forked gloo groups (2 and 4 workers).

The tiny Llama with rank-8 adapters on all of its block linears (so both column- and row-parallel linears
carry adapters under tensor parallel), and the tiny MoE model with adapters on attention under expert
parallel, train 4 steps; the workers run the runtime object (`build_runtime`,
then `train_step`, tests/distributed/forked_training.py), the pytest process the same steps on one process
with no mesh. Loss and grad norm must agree within 1e-4 at every step. Also checked on every layout: only
the adapters hold gradients and optimizer state, and the frozen base does not move.
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason(
        "one forked group trains every LoRA layout once; the first test pays it, the others read it"
    ),
]

TOL = 1e-4
STEPS = 4
# A high learning rate and grad_clip below the norms: the adapters move the loss within 5 steps, and the
# global norm over the adapters' shards is used to clip.
COMMON = [
    "peft=lora",
    "peft.targets=[all-linear]",
    "peft.alpha=32",
    "training.seq_len=32",
    "optim.warmup_steps=2",
    "optim.lr=2e-2",
    "training.grad_clip=0.05",
]
EXPERTS = ["recipe=tiny_fsdp", "model=tiny_moe", "peft.targets=[wq,wk,wv,wo]", "peft.target_experts=true"]
MOE_SHARED = ["model=tiny_moe", "model.moe.num_shared_experts=1", "peft.targets=[wq,wk,wv,wo,w1,w2,w3]"]
REFERENCES = {
    "tiny": ["recipe=tiny_tp", "training.micro_batch=4"],
    "tiny_gb8": ["recipe=tiny_ddp", "training.micro_batch=8"],
    # The generic MoE entry has no Hugging Face names: its targets are its own (attention's linears).
    "tiny_moe_gb8": ["recipe=tiny_fsdp", "model=tiny_moe", "peft.targets=[wq,wk,wv,wo]", "training.micro_batch=8"],
    # ... with the routed experts adapted too (peft.target_experts: PEFT's target_parameters).
    "tiny_moe_experts_gb8": [
        "recipe=tiny_fsdp",
        "model=tiny_moe",
        "peft.targets=[wq,wk,wv,wo]",
        "peft.target_experts=true",
        "training.micro_batch=8",
    ],
    # ... with a shared expert (adapted, split by TP with its linears) beside the frozen routed experts.
    "tiny_moe_shared": ["recipe=tiny_tp", *MOE_SHARED, "training.micro_batch=4"],
}
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    "ddp_2": (2, "tiny_gb8", ["recipe=tiny_ddp", "training.micro_batch=4"]),
    "zero1_2": (2, "tiny_gb8", ["recipe=tiny_ddp", "strategy=zero1", "training.micro_batch=4"]),
    "zero2_2": (2, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=zero2", "training.micro_batch=4"]),
    "zero3_2": (2, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"]),
    "tp_sp_2": (2, "tiny", ["recipe=tiny_tp", "training.micro_batch=4"]),
    "pp_1f1b_2": (2, "tiny", ["recipe=tiny_pp", "training.micro_batch=4", "strategy.pp_schedule=1f1b"]),
    "moe_ep_zero3_2": (
        2,
        "tiny_moe_gb8",
        ["recipe=tiny_fsdp", "model=tiny_moe", "peft.targets=[wq,wk,wv,wo]", "training.micro_batch=4", "strategy.ep=2"],
    ),
    "moe_experts_zero3_2": (2, "tiny_moe_experts_gb8", [*EXPERTS, "training.micro_batch=4"]),
    "moe_experts_ep_2": (2, "tiny_moe_experts_gb8", [*EXPERTS, "training.micro_batch=4", "strategy.ep=2"]),
    # Frozen routed experts split on their width by tensor parallel (dtlaunch.models.moe.tp_plan).
    "moe_tp_sp_2": (2, "tiny_moe_shared", ["recipe=tiny_tp", *MOE_SHARED, "training.micro_batch=4"]),
    "hsdp_2x2": (4, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=hsdp", "training.micro_batch=2"]),
    "fsdp_tp_2x2": (4, "tiny", ["recipe=tiny_tp", "strategy=fsdp_tp", "training.micro_batch=2"]),
}


def frozen_base(rt) -> dict:
    """After training: frozen parameters with a gradient, frozen parameters that moved from their initial
    value (gathered whole), and optimizer state entries that are not adapters."""
    import torch

    from dtlaunch.train.parallel.init_weights import model_param_name

    seed = int(rt.cfg.training.seed)
    frozen = with_grad = moved = 0
    for part in rt.model_parts:
        model = getattr(part, "module", part)  # DDP's wrapper
        for name, p in part.named_parameters():
            if p.requires_grad:
                continue
            frozen += 1
            with_grad += p.grad is not None
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            init = model.init_param(model_param_name(name), tuple(full.shape), seed)
            moved += not torch.equal(full.detach(), init.to(full.dtype))
    optimized = [p for opt in rt.optimizers for p in getattr(opt, "optim", opt).state]
    return {
        "frozen": frozen,
        "frozen_with_grad": with_grad,
        "frozen_moved": moved,
        "frozen_in_optimizer": sum(not p.requires_grad for p in optimized),
        "optimized": len(optimized),
    }


def _overrides(base: list[str], world: int) -> list[str]:
    return [*COMMON, *base, f"launch.nproc_per_node={world}"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out: dict = {}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}):
        names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]

        def run_all(names: list[str] = names, world: int = world) -> dict:
            return {n: train(_overrides(LAYOUTS[n][2], world), world, STEPS, frozen_base) for n in names}

        out.update(run_forked(world, run_all, tmp_path_factory.mktemp(f"lora_{world}") / "results.json"))
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for model, base in REFERENCES.items():
        ref = train(_overrides(base, 1), 1, STEPS)
        assert ref["loss"][-1] < ref["loss"][0] - 0.05, ref  # the adapters really move the loss
        assert min(ref["grad_norm"][1:]) > 0.05, ref  # clipping is exercised, not only logged
        out[model] = ref
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_parity(name: str, launched, references) -> None:
    got, want = launched[name], references[LAYOUTS[name][1]]
    report = got["inspect"]
    assert (
        report["frozen"] > 0
        and report["optimized"] > 0
        and report["frozen_with_grad"] == report["frozen_in_optimizer"] == 0
    ), report
    assert report["frozen_moved"] == 0, report
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{name} {key}: max |diff| {diff:.2e}\n{got[key]}\n{want[key]}"
