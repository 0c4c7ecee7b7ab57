"""objective=reward: DDP(2) and ZeRO-3(2, with accumulation) against one process (gloo, 2 forked workers).

The seeded preference pairs of test_dpo_layouts.py (prompts and completions of different lengths, some cut)
go through the worker's TokenLoader; the workers build the runtime as a run does (the scalar head in place
of the LM head, dtlaunch.models.score_head), one process the plain model with the same head. Loss and grad
norm must agree within 1e-5 at every step.
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train
from test_dpo_layouts import pairs

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 3
COMMON = [
    "objective=reward",
    "objective.center_rewards_coefficient=0.01",
    "training.seq_len=16",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.global_batch=8",
]
ONE = ["recipe=tiny_ddp", "training.micro_batch=8"]
LAYOUTS = {
    "ddp": ["recipe=tiny_ddp", "training.micro_batch=4"],
    "zero3": ["recipe=tiny_fsdp", "strategy=zero3", "training.micro_batch=2"],  # + accumulation
}
PAD = 0  # SeededPairs pads its rows with 0


def _prepare(rt, loader) -> None:
    rt.objective.pad_id = PAD  # what the objective's step_data reads off the prepared pairs in a run


def _inspect(rt) -> dict:
    model = getattr(rt.model_parts[0], "module", rt.model_parts[0])  # under DDP
    return {"objective": type(rt.objective).__name__, "score": list(model.score.weight.shape)}


def _run(base: list[str], world: int) -> dict:
    from dtlaunch.models.score_head import add_score_head

    overrides = [*COMMON, *base, f"launch.nproc_per_node={world}"]
    convert = (lambda model, cfg: add_score_head(model)) if world == 1 else None
    return train(overrides, world, STEPS, make_batches=pairs, prepare=_prepare, convert=convert, inspect=_inspect)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reward")

    def run_all() -> dict:
        import torch.distributed as dist

        got = {n: _run(base, 2) for n, base in LAYOUTS.items()}
        if dist.get_rank() == 0:  # the one process, in the same forked group (no collective)
            got["one"] = _run(ONE, 1)
        return got

    return run_forked(2, run_all, out / "results.json")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reward_layout_matches_one_process(results: dict, layout: str) -> None:
    want, got = results["one"], results[layout]
    assert got["inspect"] == {"objective": "RewardObjective", "score": [1, 64]}
    assert want["loss"][-1] < want["loss"][0]  # it learns the pairs
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True), start=1):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), (layout, key, step, a, b)
