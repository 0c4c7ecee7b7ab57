"""objective=grpo under FSDP2: the rollout gathers the weights once, not once per decode step.

Two forked gloo ranks build the worker's runtime (ZeRO-3: every unit reshards after forward) and generate
greedily 6 tokens for a left-padded batch, counting FSDP's all-gathers, once plainly and once inside
`gathered_for_generation` (what the rollout runs). Plainly every forward gathers every unit again
(prefill + 5 decode steps = 6 rounds of one all-gather per unit); inside, one round. The completions are the same, and on exit the
units are back to their shards with their own reshard setting."""

from __future__ import annotations

from forked_training import run_forked, train

NEW_TOKENS = 6
OVERRIDES = [
    "objective=grpo",
    "data.kind=synthetic",
    "strategy=fsdp",
    "launch.nproc_per_node=2",
    "training.seq_len=16",
    f"objective.max_completion_length={NEW_TOKENS}",
    "objective.num_generations=2",
    "training.micro_batch=2",
    "training.global_batch=4",
]


def _count_gathers(rt) -> dict:
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtlaunch.infer.batch_generate import Sampling, generate_batch
    from dtlaunch.train.parallel.generation_gather import fsdp_units, gathered_for_generation

    model = rt.model_parts[0]
    prompts = [[3, 4, 5, 6], [7, 8]]
    greedy = Sampling(NEW_TOKENS, temperature=0.0)
    calls = {"n": 0}
    real = dist.all_gather_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    out = {"units": len(fsdp_units(model))}
    with mock.patch.object(dist, "all_gather_single", counting):
        plain = generate_batch(model, prompts, greedy, stop_ids=[])
        out["per_forward"], calls["n"] = calls["n"], 0
        with gathered_for_generation(model):
            once = generate_batch(model, prompts, greedy, stop_ids=[])
        out["once"], calls["n"] = calls["n"], 0
        generate_batch(model, prompts, greedy, stop_ids=[])  # the saved setting is back: per forward again
        out["after"] = calls["n"]
    out["same"] = plain.completions == once.completions and len(plain.completions[0]) == NEW_TOKENS
    out["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_fsdp_rollout_gathers_the_weights_once() -> None:
    import tempfile
    from pathlib import Path

    def run_all() -> dict:
        return train(OVERRIDES, 2, 0, inspect=_count_gathers)["inspect"]

    with tempfile.TemporaryDirectory() as tmp:
        r = run_forked(2, run_all, Path(tmp) / "results.json")
    assert r["same"] and r["resharded"], r
    # Every unit gathered in every forward (prefill + NEW_TOKENS - 1 decode steps) plainly; once inside.
    # (An FSDP unit whose parameters all sit in child units, the root here, gathers nothing.)
    assert r["per_forward"] == NEW_TOKENS * r["once"] and 1 < r["once"] <= r["units"], r
    assert r["after"] == r["per_forward"], r
