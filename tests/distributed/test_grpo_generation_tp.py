"""objective=grpo under tensor parallel: the rollout generates on the TP shards.

Two forked gloo ranks build the worker's runtime with strategy=tp (sequence parallel on, the default, and
off) and generate a left-padded batch of prompts of different lengths; the one-process model with the
same initial weights generates the same batch. Greedy and seeded sampled completions must be equal, and sampled ones the
same on both TP ranks (each draws from the gathered logits with the same generator: a rank that drew
differently would feed its peer's collectives different tokens).

A tool-calling continuation too (generate_batch's `shared`: each prompt prefilled once, then each row's own
suffix, _shared_prefill): the TP shards' completions equal the one process's, and those of the same rows
prefilled whole, greedy and sampled. Models: dense, MoE, DeepSeek-V3's latent attention and Qwen3-Next's
Gated DeltaNet (its recurrent state on the key-head shards; without sequence parallel)."""

from __future__ import annotations

import pytest
import tiny_models
from forked_training import one_process_runtime, run_forked, train

NEW_TOKENS = 7
PROMPTS = [[3, 4, 5, 6, 9], [7, 8], [10, 11, 12]]  # odd lengths: sequence parallel pads them to even
# A continuation's rows, as the unit test builds them (tests/unit/test_batch_generate.py): each prompt with
# each row's own turn after it (1 to 4 tokens: odd and even), `shared` its prompt's length. The longest
# row + NEW_TOKENS stays within seq_len's RoPE positions.
SUFFIXES = [[9], [30, 31, 32], [50, 51], [70, 71, 72, 73]]
ROWS = [p + x for p in PROMPTS for x in SUFFIXES]
SHARED = [len(p) for p in PROMPTS for _ in SUFFIXES]
# Each row's room left, as the rollout's continuation passes it (`limits`): rows end at 2 to 7 tokens, so the
# decode batch drops finished rows (_drop_finished) from the caches the shared prefill placed.
LIMITS = [NEW_TOKENS, 3, 5, 2] * len(PROMPTS)
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


def _generate(model, sequence_multiple: int, temperature: float, continuation: str = "") -> list:
    """PROMPTS' completions; with `continuation` ("shared" or "whole"), ROWS' (capped at LIMITS) with their
    prefixes shared or every row prefilled whole."""
    import torch

    from dtlaunch.infer.batch_generate import Sampling, generate_batch

    s = Sampling(NEW_TOKENS, temperature=temperature)
    g = torch.Generator().manual_seed(5)
    prompts, shared, limits = (PROMPTS, None, None)
    if continuation:
        prompts, shared, limits = ROWS, SHARED if continuation == "shared" else None, LIMITS
    out = generate_batch(
        model, prompts, s, [], generator=g, sequence_multiple=sequence_multiple, limits=limits, shared=shared
    )
    return out.completions


def _compare(overrides: list, sp: bool):
    def inspect(rt) -> dict:
        import torch
        import torch.distributed as dist

        from dtlaunch.job.compose import compose

        multiple = 2 if sp else 1
        model = rt.model_parts[0]
        tp = {"greedy": _generate(model, multiple, 0.0), "sampled": _generate(model, multiple, 1.0)}
        shapes: list = []  # each forward's tokens: the shared path's two prefills, then the decode steps
        hook = model.register_forward_pre_hook(lambda _, args: shapes.append(list(args[0].shape)))
        for t, kind in ((0.0, "greedy"), (1.0, "sampled")):
            shapes.clear()
            tp[f"shared_{kind}"] = _generate(model, multiple, t, "shared")
        hook.remove()
        tp["shared_prefills"] = shapes[:2]
        one = one_process_runtime(compose(overrides).cfg, torch.device("cpu")).model_parts[0]
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, [tp["sampled"], tp["shared_sampled"]])
        one_out = {"one": _generate(one, 1, 0.0), "one_sampled": _generate(one, 1, 1.0)}
        for t, kind in ((0.0, "greedy"), (1.0, "sampled")):
            for how in ("shared", "whole"):
                one_out[f"one_{how}_{kind}"] = _generate(one, 1, t, how)
        return {**tp, **one_out, "peers_agree": all(p == peers[0] for p in peers)}

    return inspect


# An MoE model too: every routed expert split on its width, the shared expert column/row-parallel.
MOE = ["model=tiny_moe", "model.moe.num_shared_experts=1"]
# DeepSeek-V3's latent attention split by heads: each rank caches its heads' keys and values.
DEEPSEEK_V3 = [*tiny_models.DEEPSEEK_V3, "model.q_lora_rank=24", "model.v_head_dim=10"]
# Qwen3-Next's Gated DeltaNet split by key heads: each rank keeps its heads' recurrent and conv states. Without
# sequence parallel only (under it the rollout is refused: its filler copies would enter the recurrent state).
QWEN3_NEXT = ["model=tiny", "model.arch=qwen3_next", "model.qk_norm=true", "model.moe.num_experts=4"]
QWEN3_NEXT += ["model.linear_num_key_heads=2", "model.linear_num_value_heads=4"]
CASES = [
    (True, []),
    (False, []),
    (True, MOE),
    (False, MOE),
    (True, DEEPSEEK_V3),
    (False, DEEPSEEK_V3),
    (False, QWEN3_NEXT),
]


@pytest.mark.parametrize(
    ("sp", "model"),
    CASES,
    ids=["sp", "no_sp", "moe_sp", "moe_no_sp", "deepseek_v3_sp", "deepseek_v3_no_sp", "qwen3_next_no_sp"],
)
def test_tensor_parallel_generates_as_one_process(tmp_path, sp: bool, model: list) -> None:
    overrides = [*OVERRIDES, *model, f"strategy.sequence_parallel={str(sp).lower()}"]

    def run_all() -> dict:
        return train(overrides, 2, 0, inspect=_compare(overrides, sp))["inspect"]

    r = run_forked(2, run_all, tmp_path / "results.json")
    assert r["greedy"] == r["one"] and all(len(c) == NEW_TOKENS for c in r["one"]), r
    assert r["sampled"] == r["one_sampled"] != r["one"], r  # the same seeded draws from the same weights
    assert r["peers_agree"], r
    # The continuation: prefixes shared on the TP shards, as on one process, as every row prefilled whole.
    for kind in ("greedy", "sampled"):
        want = r[f"one_whole_{kind}"]
        assert r[f"shared_{kind}"] == r[f"one_shared_{kind}"] == want, (kind, r)
        assert [len(c) for c in want] == LIMITS, want
    assert r["one_whole_sampled"] != r["one_whole_greedy"], r
    # Each prompt once (the longest, 5, rounded to sequence parallel's 2), then the rows' last 4 positions;
    # Qwen3-Next's recurrent state shares no prefix: every row prefilled whole (9 tokens), then decoded.
    want = [[len(ROWS), 9], [len(ROWS), 1]] if model == QWEN3_NEXT else [[len(PROMPTS), 6 if sp else 5], [len(ROWS), 4]]
    assert r["shared_prefills"] == want, r["shared_prefills"]
