"""LoRA loss parity of every parallel layout with one process, in two forked gloo groups (2 and 4 workers).

The tiny Llama with rank-8 adapters on all of its block linears (so both column- and row-parallel linears
carry adapters under tensor parallel) trains 4 steps; the workers run the runtime object (`build_runtime`,
then `train_step`, tests/distributed/forked_training.py), the pytest process the same steps on one process
with no mesh. Loss and grad norm must agree within 1e-4 at every step. Also checked on every layout: only
the adapters hold gradients and optimizer state, and the frozen base does not move.
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

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
REFERENCES = {
    "tiny": ["recipe=tiny_tp", "training.micro_batch=4"],
    "tiny_gb8": ["recipe=tiny_ddp", "training.micro_batch=8"],
}
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    "ddp_2": (2, "tiny_gb8", ["recipe=tiny_ddp", "training.micro_batch=4"]),
    "zero1_2": (2, "tiny_gb8", ["recipe=tiny_ddp", "strategy=zero1", "training.micro_batch=4"]),
    "zero2_2": (2, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=zero2", "training.micro_batch=4"]),
    "zero3_2": (2, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"]),
    "tp_sp_2": (2, "tiny", ["recipe=tiny_tp", "training.micro_batch=4"]),
    "pp_1f1b_2": (2, "tiny", ["recipe=tiny_pp", "training.micro_batch=4", "strategy.pp_schedule=1f1b"]),
    "hsdp_2x2": (4, "tiny_gb8", ["recipe=tiny_fsdp", "strategy=hsdp", "training.micro_batch=2"]),
    "fsdp_tp_2x2": (4, "tiny", ["recipe=tiny_tp", "strategy=fsdp_tp", "training.micro_batch=2"]),
}


def _overrides(base: list[str], world: int) -> list[str]:
    return [*base, *COMMON, f"launch.nproc_per_node={world}"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out: dict = {}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}):
        names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]

        def run_all(names: list[str] = names, world: int = world) -> dict:
            return {n: train(_overrides(LAYOUTS[n][2], world), world, STEPS) for n in names}

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
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{name} {key}: max |diff| {diff:.2e}\n{got[key]}\n{want[key]}"
