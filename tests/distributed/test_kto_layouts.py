"""objective=kto: loss parity of DDP(2), ZeRO-3(2) with accumulation, TP(2) and CP(2) with one process
(gloo, 2 forked workers, one group for every layout).

Seeded examples go through the worker's TokenLoader: each sample is an example's own row and its KL row
(test_dpo_layouts.SeededPairs' two rows), labelled desirable unless its index is a multiple of 3, so a
micro-batch holds both kinds. KTO's KL estimate is a mean over a micro-step's examples on every rank
(averaged over the ranks), so the one process runs the same examples per micro-step: 8 (DDP: 2 ranks x 4;
TP and CP: 1 data-parallel rank of 8), or 4 over 2 accumulation micro-steps (ZeRO-3: 2 ranks x 2). Loss and
grad norm agree within 1e-5 at every step; the first loss is 0.5 x the step's mean example weight (the
policy starts as its reference copy: every log-ratio and the KL estimate are 0, 1 - sigmoid(0) = 0.5).
"""

from __future__ import annotations

import numpy as np
import pytest
from forked_training import run_forked, train
from test_dpo_layouts import SeededPairs

TOL = 1e-5
STEPS = 3
COMMON = [
    "objective=kto",
    "objective.beta=0.5",
    "objective.desirable_weight=1.5",
    "training.seq_len=16",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.global_batch=8",
]
REFERENCES = {
    "mb8": ["recipe=tiny_ddp", "training.micro_batch=8"],
    "mb4": ["recipe=tiny_ddp", "training.micro_batch=4"],
}
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "ddp": ("mb8", ["recipe=tiny_ddp", "training.micro_batch=4"]),
    "zero3": ("mb4", ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=2"]),
    "tp": ("mb8", ["recipe=tiny_tp", "training.micro_batch=8"]),
    "cp": ("mb8", ["recipe=tiny_fsdp", "strategy.cp=2", "strategy.dp_shard=1", "training.micro_batch=8"]),
}


class SeededExamples(SeededPairs):
    """SeededPairs' samples as KTO examples (own row, KL row), with labels."""

    def labels(self, indices: list[int]) -> np.ndarray:
        return np.asarray(indices) % 3 != 0


def examples(cfg, gb: int, dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1):
    from dtlaunch.train.data import TokenLoader

    t, vocab = cfg.training, int(cfg.model.vocab_size)
    source = SeededExamples(int(t.seq_len), vocab)
    cp = {"cp_rank": cp_rank, "cp_size": cp_size}
    return TokenLoader(source, int(t.micro_batch), int(t.seq_len), 5, dp_rank, dp_size, vocab, global_batch=gb, **cp)


def _overrides(base: list[str], world: int) -> list[str]:
    return [*COMMON, *base, f"launch.nproc_per_node={world}"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {n: train(_overrides(base, 2), 2, STEPS, make_batches=examples) for n, (_, base) in LAYOUTS.items()}

    return run_forked(2, run_all, tmp_path_factory.mktemp("kto_2") / "results.json")


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for name, base in REFERENCES.items():
        ref = train(_overrides(base, 1), 1, STEPS, make_batches=examples)
        # The policy starts as the reference: each example's loss is 0.5 times its weight (1.5 desirable).
        desirable = (ref["loss"][0] / 0.5 * 8 - 8) / 0.5
        assert desirable == pytest.approx(round(desirable), abs=1e-4) and 0 < round(desirable) < 8, ref
        assert abs(ref["loss"][-1] - 0.5) > 20 * TOL, ref  # and moved away, by far more than the tolerance
        out[name] = ref
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kto_parity(name: str, launched, references) -> None:
    ref, got = references[LAYOUTS[name][0]], launched[name]
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(ref[key], got[key], strict=True))
        assert diff <= TOL, (name, key, ref[key], got[key])


def test_micro_step_grouping_matters(references) -> None:
    """The KL estimate is a micro-step's: grouping the same examples differently changes the loss (so the
    parity above compares like with like, and would see a layout that grouped them wrongly)."""
    assert abs(references["mb8"]["loss"][-1] - references["mb4"]["loss"][-1]) > 20 * TOL
