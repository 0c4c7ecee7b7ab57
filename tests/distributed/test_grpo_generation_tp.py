"""objective=grpo under tensor parallel: the rollout generates on the TP shards.

Two forked gloo ranks build the worker's runtime with strategy=tp (sequence parallel on, the default, and
off) and generate a left-padded batch of prompts of different lengths; the one-process model with the
same initial weights generates the same batch. Greedy and seeded sampled completions must be equal, and sampled ones the
same on both TP ranks (each draws from the gathered logits with the same generator: a rank that drew
differently would feed its peer's collectives different tokens)."""

from __future__ import annotations

import pytest
import tiny_models
from forked_training import one_process_runtime, run_forked, train

NEW_TOKENS = 7
PROMPTS = [[3, 4, 5, 6, 9], [7, 8], [10, 11, 12]]  # odd lengths: sequence parallel pads them to even
OVERRIDES = [
    "objective=grpo",
    "data.kind=synthetic",
    "strategy=tp",
    "launch.nproc_per_node=2",
    "training.seq_len=16",
    f"objective.max_completion_length={NEW_TOKENS}",
    "objective.num_generations=2",
    "training.micro_batch=2",
    "training.global_batch=2",
]


def _generate(model, sequence_multiple: int, temperature: float) -> list:
    import torch

    from dtlaunch.infer.batch_generate import Sampling, generate_batch

    s = Sampling(NEW_TOKENS, temperature=temperature)
    g = torch.Generator().manual_seed(5)
    out = generate_batch(model, PROMPTS, s, stop_ids=[], generator=g, sequence_multiple=sequence_multiple)
    return out.completions


def _compare(overrides: list, sp: bool):
    def inspect(rt) -> dict:
        import torch
        import torch.distributed as dist

        from dtlaunch.config.compose import compose

        multiple = 2 if sp else 1
        tp = {
            "greedy": _generate(rt.model_parts[0], multiple, 0.0),
            "sampled": _generate(rt.model_parts[0], multiple, 1.0),
        }
        one = one_process_runtime(compose(overrides).cfg, torch.device("cpu")).model_parts[0]
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, tp["sampled"])
        one_out = {"one": _generate(one, 1, 0.0), "one_sampled": _generate(one, 1, 1.0)}
        return {**tp, **one_out, "peers_agree": all(p == peers[0] for p in peers)}

    return inspect


# An MoE model too: every routed expert split on its width, the shared expert column/row-parallel.
MOE = ["model=tiny_moe", "model.moe.num_shared_experts=1"]
# DeepSeek-V3's latent attention split by heads: each rank caches its heads' keys and values.
DEEPSEEK_V3 = [*tiny_models.DEEPSEEK_V3, "model.q_lora_rank=24", "model.v_head_dim=10"]
CASES = [(True, []), (False, []), (True, MOE), (False, MOE), (True, DEEPSEEK_V3), (False, DEEPSEEK_V3)]


@pytest.mark.parametrize(
    ("sp", "model"), CASES, ids=["sp", "no_sp", "moe_sp", "moe_no_sp", "deepseek_v3_sp", "deepseek_v3_no_sp"]
)
def test_tensor_parallel_generates_as_one_process(tmp_path, sp: bool, model: list) -> None:
    overrides = [*OVERRIDES, *model, f"strategy.sequence_parallel={str(sp).lower()}"]

    def run_all() -> dict:
        return train(overrides, 2, 0, inspect=_compare(overrides, sp))["inspect"]

    r = run_forked(2, run_all, tmp_path / "results.json")
    assert r["greedy"] == r["one"] and all(len(c) == NEW_TOKENS for c in r["one"]), r
    assert r["sampled"] == r["one_sampled"] != r["one"], r  # the same seeded draws from the same weights
    assert r["peers_agree"], r
