"""DPO loss parity of the parallel layouts with one process (gloo, 2 forked workers), and the precomputed
reference against the live one.

HSDP (2 replicas x 2 shards) runs in a second group of 4 workers. QLoRA (an NF4 base) is compared with one
process holding the same NF4 base: in fp32 within 1e-5 like the others, in bf16 within QLoRA's layout
tolerance (tests/distributed/test_qlora.py's LAYOUT_TOL, at its learning rate and alpha).

Seeded preference pairs (random prompts and completions of different lengths, cut at seq_len + 1 tokens)
go through the worker's TokenLoader, so every layout sees the same pairs, each chosen row in the same
micro-batch as its rejected row. Full fine-tuning uses a frozen reference copy sharded like the policy;
LoRA the base with its adapters switched off. Loss and grad norm must agree within 1e-5 at every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from forked_training import run_forked, train
from test_qlora import LAYOUT_TOL as QLORA_LAYOUT_TOL

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 3
COMMON = [
    "objective=dpo",
    "objective.beta=0.5",
    "training.seq_len=16",
    "optim.warmup_steps=1",
    "optim.lr=3e-2",
    "training.global_batch=8",
]
LORA = ["peft=lora", "peft.targets=[all-linear]", "peft.alpha=32"]
# Small NF4 blocks, as test_qlora.py: the tiny model's row shards must hold whole scaler blocks.
QLORA = ["peft=qlora", "peft.alpha=32", "peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"]
# bf16: FSDP2 casts the parameters (MixedPrecisionPolicy), one process autocasts the matmuls. At this
# module's lr 3e-2 and alpha 32 that rounding moves the third step's loss by 6e-3 for LoRA as much as for
# QLoRA (measured: 6.2e-3 and 7.2e-3; 0 in fp32), beyond test_qlora.py's tolerance, which holds at its own
# lr 1e-2 and alpha 16 (measured here: 1.7e-3).
QLORA_BF16 = [*QLORA, "precision=bf16", "optim.lr=1e-2", "peft.alpha=16"]
REFERENCES = {
    "full": ["recipe=tiny_ddp", "training.micro_batch=8"],
    "lora": [*LORA, "recipe=tiny_ddp", "training.micro_batch=8"],
    "qlora": [*QLORA, "recipe=tiny_ddp", "training.micro_batch=8"],
    "qlora_bf16": [*QLORA_BF16, "recipe=tiny_ddp", "training.micro_batch=8"],
}
KIND_TOL = {"full": TOL, "lora": TOL, "qlora": TOL, "qlora_bf16": QLORA_LAYOUT_TOL}
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "ddp": ("full", ["recipe=tiny_ddp", "training.micro_batch=4"]),
    "zero1": ("full", ["recipe=tiny_ddp", "strategy=zero1", "training.micro_batch=4"]),
    "zero3": ("full", ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=2"]),  # + accumulation
    "tp": ("full", ["recipe=tiny_tp", "training.micro_batch=8"]),
    "lora_ddp": ("lora", [*LORA, "recipe=tiny_ddp", "training.micro_batch=4"]),
    "lora_zero2": ("lora", [*LORA, "recipe=tiny_fsdp", "strategy=zero2", "training.micro_batch=4"]),
    "lora_tp": ("lora", [*LORA, "recipe=tiny_tp", "training.micro_batch=8"]),
    "qlora_zero3": ("qlora", [*QLORA, "recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"]),
    "qlora_zero3_bf16": ("qlora_bf16", [*QLORA_BF16, "recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=4"]),
}
LAYOUTS_4: dict[str, tuple[str, list[str]]] = {
    "hsdp": ("full", ["recipe=tiny_fsdp", "strategy=hsdp", "training.micro_batch=2"]),
    "lora_hsdp": ("lora", [*LORA, "recipe=tiny_fsdp", "strategy=hsdp", "training.micro_batch=2"]),
}


class SeededPairs:
    """PairSource's samples, (2, 2, seq_len + 1) [chosen, rejected] x [ids, completion mask], drawn from
    (seed, index): prompts of 2-9 tokens, completions of 2-11 (some rows longer than seq_len + 1, cut)."""

    num_samples = 64

    def __init__(self, seq_len: int, vocab: int) -> None:
        self.length, self.vocab = seq_len + 1, vocab

    def sample(self, index: int) -> np.ndarray:
        from dtlaunch.data.preference import cut

        rng = np.random.default_rng([3, index])
        prompt_len = int(rng.integers(2, 10))
        prompt = rng.integers(0, self.vocab, prompt_len)
        out = np.zeros((2, 2, self.length), dtype=np.int64)
        for side in range(2):
            row = np.concatenate([prompt, rng.integers(0, self.vocab, int(rng.integers(2, 12)))])
            skip, n = cut(prompt_len, len(row), self.length)
            out[side, 0, :n] = row[skip : skip + n]
            out[side, 1, prompt_len - skip : n] = 1
        return out


def pairs(cfg, gb: int, dp_rank: int, dp_size: int):
    from dtlaunch.train.data import TokenLoader

    t = cfg.training
    source = SeededPairs(int(t.seq_len), int(cfg.model.vocab_size))
    return TokenLoader(
        source, int(t.micro_batch), int(t.seq_len), 5, dp_rank, dp_size, int(cfg.model.vocab_size), global_batch=gb
    )


def precompute(rt, loader) -> None:
    """objective.precompute_reference's pass, then training with the table instead of a live reference."""
    from dtlaunch.train.objectives.precompute import score_pairs
    from dtlaunch.train.objectives.reference import Precomputed

    loader.ref_logps = score_pairs(rt.cfg, rt, loader, loader.source.num_samples)
    assert not np.isnan(loader.ref_logps).any()
    rt.reference = Precomputed()


def _overrides(base: list[str], world: int) -> list[str]:
    return [*COMMON, *base, f"launch.nproc_per_node={world}"]


def _convert(overrides: list[str]):
    """QLoRA's one process quantises its base as the workers' build_runtime does."""
    if "peft=qlora" not in overrides:
        return None
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    return lambda model, cfg: convert_frozen_base(model, cfg, 1)


def _launch(layouts: dict, world: int, tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {n: train(_overrides(layouts[n][1], world), world, STEPS, make_batches=pairs) for n in layouts}

    return run_forked(world, run_all, tmp_path_factory.mktemp(f"dpo_{world}") / "results.json")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    return _launch(LAYOUTS, 2, tmp_path_factory)


@pytest.fixture(scope="module")
def launched_4(tmp_path_factory) -> dict:
    return _launch(LAYOUTS_4, 4, tmp_path_factory)


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for name, base in REFERENCES.items():
        ref = train(_overrides(base, 1), 1, STEPS, make_batches=pairs, convert=_convert(base))
        assert ref["loss"][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
        # The policy moved away from the reference (bf16 QLoRA, at test_qlora.py's lower lr and alpha, less:
        # its layout check bounds the rounding; the exact one is the fp32 QLoRA case).
        assert abs(ref["loss"][-1] - math.log(2)) > (1e-3 if KIND_TOL[name] == TOL else 2e-4), ref
        out[name] = ref
    return out


def _assert_parity(name: str, got: dict, kind: str, references: dict) -> None:
    want = references[kind]
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= KIND_TOL[kind], f"{name} {key}: max |diff| {diff:.2e}\n{got[key]}\n{want[key]}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_parity(name: str, launched, references) -> None:
    _assert_parity(name, launched[name], LAYOUTS[name][0], references)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_dpo_parity_hsdp(name: str, launched_4, references) -> None:
    """strategy.dp_replicate=2 x dp_shard=2 on 4 workers."""
    _assert_parity(name, launched_4[name], LAYOUTS_4[name][0], references)


@pytest.mark.parametrize("kind", list(REFERENCES))
def test_precomputed_reference_gives_the_live_losses(kind: str, references) -> None:
    base = REFERENCES[kind]
    got = train(_overrides(base, 1), 1, STEPS, make_batches=pairs, prepare=precompute, convert=_convert(base))
    assert got["loss"] == pytest.approx(references[kind]["loss"], abs=1e-6)
