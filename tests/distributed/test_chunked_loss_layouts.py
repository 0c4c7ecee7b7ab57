"""training.loss_chunks=8 (the chunked head + cross-entropy, dtlaunch/train/chunked_loss.py) in 2-process
gloo layouts against one process computing the full-vocabulary loss (loss_chunks=1): DDP, FSDP2 (ZeRO-3,
the head's weight gathered while the loss runs), tensor parallel with and without sequence parallel
(vocabulary-sharded head, loss-parallel per chunk), a 1F1B pipeline (the last stage's loss), LoRA (frozen,
tied head) and an MoE model with its auxiliary loss. fp32, 4 steps: loss and grad norm at every step.
The MoE balance loss is computed over each rank's own tokens, so its reference is the same 2-process
layout with loss_chunks=1 rather than one process.
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 4
COMMON = ["training.seq_len=32", "optim.warmup_steps=2", "optim.lr=1e-2", "training.grad_clip=0.5"]
CHUNKED, FULL = "training.loss_chunks=8", "training.loss_chunks=1"
LORA = ["peft=lora", "peft.targets=[all-linear]", "model.tie_embeddings=true"]
MOE = ["model=tiny_moe", "model.moe.aux_loss_coef=0.01"]
REFERENCES = {
    "tiny": ["recipe=tiny_tp", "training.micro_batch=4"],
    "tiny_gb8": ["recipe=tiny_ddp", "training.micro_batch=8"],
    "lora_gb8": ["recipe=tiny_ddp", *LORA, "training.micro_batch=8"],
}
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "ddp": ("tiny_gb8", ["recipe=tiny_ddp", "training.micro_batch=4"]),
    "zero3": ("tiny_gb8", ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"]),
    "tp_sp": ("tiny", ["recipe=tiny_tp", "training.micro_batch=4"]),
    "tp_no_sp": ("tiny", ["recipe=tiny_tp", "training.micro_batch=4", "strategy.sequence_parallel=false"]),
    "pp_1f1b": ("tiny", ["recipe=tiny_pp", "training.micro_batch=4", "strategy.pp_schedule=1f1b"]),
    "lora_zero3_tied": ("lora_gb8", ["recipe=tiny_fsdp", *LORA, "training.micro_batch=4"]),
    "moe_zero3": ("moe_zero3_full", ["recipe=tiny_fsdp", *MOE, "training.micro_batch=4"]),
}
# References run in the same 2-process group, with the full-vocabulary loss.
FORKED_REFERENCES = {"moe_zero3_full": ["recipe=tiny_fsdp", *MOE, "training.micro_batch=4"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    def run_all() -> dict:
        runs = {n: [*ov, CHUNKED] for n, (_, ov) in LAYOUTS.items()}
        runs.update({n: [*ov, FULL] for n, ov in FORKED_REFERENCES.items()})
        return {n: train([*ov, *COMMON, "launch.nproc_per_node=2"], 2, STEPS) for n, ov in runs.items()}

    return run_forked(2, run_all, tmp_path_factory.mktemp("chunked") / "results.json")


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: train([*ov, *COMMON, FULL, "launch.nproc_per_node=1"], 1, STEPS) for name, ov in REFERENCES.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_loss_matches_full_loss_on_one_process(name: str, launched, references) -> None:
    ref = LAYOUTS[name][0]
    got, want = launched[name], launched[ref] if ref in FORKED_REFERENCES else references[ref]
    assert want["loss"][-1] < want["loss"][0] - 0.1, want  # the updates really move the loss
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) / abs(b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max relative diff {diff:.3g} > {TOL}: {got[key]} vs {want[key]}"
