"""The Gated DeltaNet hybrids' closed-form activation terms (dtlaunch/models/qwen3_next/activations.py) under tensor
parallel: what one of 2 forked gloo ranks keeps from its first block's input to its last block's output (the
runtime's StorageCounter; the runtime's TP plan and AC) against the stage shape's count at tp=2 (the terms and the
planner's corrections), on a qwen3_5 decoder with one Gated DeltaNet block (each rank one key head and its two
value heads) and one gated full-attention block.

Exact with and without sequence parallel, with each AC mode, but for the rank's gathered in_proj_qkv and conv1d
rows, which its matmuls keep per block (not per token). Selective AC under sequence parallel keeps (1 + 1/tp)·e·h
per token and block more than the op-level count, as every dense block does (llama and qwen3, h = 64 and 128,
tp = 2 and 4: exact): the planner's shape.TP_SP_SELECTIVE_GATHERED_HIDDEN_STATES, measured here.

The same 2 ranks (the same forked group: one process start) under Ulysses context parallel, cp=2 (tp=1): each
rank runs its half of rows of 96, 136 and 200 tokens, its linear block's convolution and chunked rule on the
whole row (padded to 128, 192, 256: the chunk boundary falls elsewhere than in the rank's own tokens) for one
key head and its two value heads. Exact without AC (but for the head group's conv1d rows, per block) and with
full AC and with selective AC (each mark taken once late-freed collective buffers are gone: `_settled`).
A dense decoder (model=tiny) under Ulysses cp=2 in the same group: its blocks keep what the stage's shape counts
(plan/shape.py), the exchanged attention output that wo keeps included."""

from __future__ import annotations

import dataclasses
import gc

import pytest
from forked_training import run_forked

pytestmark = [pytest.mark.slow]

LINEAR = ["model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=16"]
LINEAR += ["model.linear_value_head_dim=24", "model.n_layers=2", "model.layer_types=[linear_attention,full_attention]"]
BASE = ["model=tiny", "model.arch=qwen3_5", "model.qk_norm=true", *LINEAR, "hardware=cpu", "precision=fp32"]
BASE += ["training.micro_batch=2", "training.global_batch=2", "strategy=tp", "launch.nproc_per_node=2"]
SEQ = 100
# (sequence parallel, activation checkpointing)
CASES = [("false", "none"), ("true", "none"), ("false", "selective"), ("true", "selective"), ("true", "full")]
# Ulysses context parallel over the same 2 ranks (tp=1): (row length, activation checkpointing). Each rank holds
# half the row (48 / 68 / 100 tokens); the linear block's rule runs on the whole row (padded to 128 / 192 / 256:
# two, three, four chunks where the rank's tokens alone would make one, two, two) for one of the two key heads
# and its two value heads.
CP = ["strategy.tp=1", "strategy.cp=2", "strategy.cp_style=ulysses", "strategy.dp_shard=1"]
CP_CASES = [(96, "none"), (136, "none"), (200, "none"), (96, "full"), (200, "full")]
CP_CASES += [(96, "selective"), (200, "selective")]


def _settled(counter) -> int:
    """Live bytes once what the forward let go of is freed. Now and then (one run in several, under load) a
    collective's buffers outlive it by a moment: gloo's worker threads drop them a moment after the call
    returns, or a reference cycle keeps them until Python's cycle collector runs (seen: one hidden-sized tensor
    under TP, one q-sized exchange's send and receive buffers under CP). Collected, then a moment's wait."""
    import time

    gc.collect()
    time.sleep(0.05)
    return counter.live


def _blocks_keep(overrides: list[str], tokens: int) -> tuple[dict, int]:
    """The worker's runtime of `overrides` on this forked rank, and what its two blocks keep from the first
    block's input to the last block's output for one micro-batch of 2 rows of `tokens` (this rank's)."""
    import torch
    import torch.distributed as dist

    from dtlaunch.job.compose import compose
    from dtlaunch.train.observe.memtrack import StorageCounter
    from dtlaunch.train.parallel.process_group import DistEnv
    from dtlaunch.train.runtime import build_runtime

    cfg = compose(overrides).cfg
    env = DistEnv(rank=dist.get_rank(), world=2, local_rank=0, restart=0, device=torch.device("cpu"), backend="gloo")
    rt = build_runtime(cfg, env)
    model = getattr(rt.model_parts[0], "module", rt.model_parts[0])  # DDP over the CP ranks
    counter = StorageCounter()
    counter.add_existing([*model.parameters(), *model.buffers()])
    marks: list[int] = []
    model.layers["0"].register_forward_pre_hook(lambda *_: marks.append(_settled(counter)))
    model.layers["1"].register_forward_hook(lambda *_: marks.append(_settled(counter)))
    with counter:
        model(torch.randint(0, int(cfg.model.vocab_size), (2, tokens)))
    return rt, marks[-1] - marks[0]


def _counted(rt, mode: str) -> float:
    """The stage shape's bytes per token of one block (plan/shape.py: the family's terms and the planner's
    measured corrections)."""
    from dtlaunch.plan.shape import stage_shape

    return stage_shape(rt.cfg, rt.decisions.layout, 0, 2, True, True).block_saved_per_token[mode]


def _kept_cp(seq: int, mode: str) -> dict:
    """What a rank keeps under Ulysses cp=2 (its local tokens through both blocks) against the terms at cp=2."""
    from dtlaunch.models.qwen3_next import activations as act

    local = seq // 2
    rt, measured = _blocks_keep(
        [*BASE, f"training.seq_len={seq}", f"training.activation_checkpointing={mode}", *CP], local
    )
    model = getattr(rt.model_parts[0], "module", rt.model_parts[0])
    exchanges = [type(m.sequence_exchange).__name__ for m in model.modules() if hasattr(m, "sequence_exchange")]
    # As plan/shape.py sets them: the rank's share of the row and the CP degree.
    d = dataclasses.replace(act.BlockDims.of(rt.cfg.model), seq=local, cp=2)
    planned = act.block_bytes(d, 4, mode, tp=1) * 2 * local * 2
    # Per block, not per token: the chunk's mask and exp(A_log) (none), and the rank's head group's conv1d rows
    # (C/2 x K, fp32) that _mix_exchanged gathers for its convolution, which keeps them (none; recomputed under AC).
    _, _, _, conv, _ = d.widths(2)
    if mode == "none":
        planned += act.linear_constant_bytes(d) + 4 * conv * d.kernel
    return {"measured": measured, "planned": planned, "exchanges": exchanges}


def _kept_dense_cp() -> dict:
    """A dense decoder (model=tiny, llama) under Ulysses cp=2 without AC: what a rank's blocks keep against the
    stage shape's per-token count (plan/shape.py: the exchanged attention output wo keeps, e·q, included)."""
    seq = 96
    dense = ["model=tiny", "model.n_layers=2", "hardware=cpu", "precision=fp32", f"training.seq_len={seq}"]
    dense += ["training.micro_batch=2", "training.global_batch=2", "launch.nproc_per_node=2"]
    rt, measured = _blocks_keep([*dense, *CP], seq // 2)
    return {"measured": measured, "planned": _counted(rt, "none") * 2 * (seq // 2) * 2}


def _kept(sp: str, mode: str) -> dict:
    from dtlaunch.models.qwen3_next import activations as act

    overrides = [
        f"training.seq_len={SEQ}",
        f"strategy.sequence_parallel={sp}",
        f"training.activation_checkpointing={mode}",
    ]
    rt, measured = _blocks_keep([*BASE, *overrides], SEQ)
    d = dataclasses.replace(act.BlockDims.of(rt.cfg.model), seq=SEQ)
    planned = _counted(rt, mode) * 2 * SEQ * 2
    if mode == "none":
        planned += act.linear_constant_bytes(d, tp=2)
    # The rank's gathered rows of in_proj_qkv (C/2 x dim) and conv1d (C/2 x K), fp32, kept by its matmuls.
    _, _, _, conv, _ = d.widths(2)
    gathered = 4 * conv * (d.h + d.kernel) if mode == "none" else 0
    return {"measured": measured, "planned": planned + gathered}


def _all() -> dict:
    tp = {f"{sp}-{mode}": _kept(sp, mode) for sp, mode in CASES}
    cp = {f"{seq}-{mode}": _kept_cp(seq, mode) for seq, mode in CP_CASES}
    return {"tp": tp, "cp": cp, "dense_cp": _kept_dense_cp()}


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> dict:
    """Both groups of cases in one forked group of 2 (one process start)."""
    return run_forked(2, _all, tmp_path_factory.mktemp("gated_deltanet_activations") / "out.json")


def test_ulysses_context_parallel_ranks_keep_what_the_plan_counts(kept) -> None:
    for (seq, mode), r in zip(CP_CASES, kept["cp"].values(), strict=True):
        assert r["exchanges"] == ["UlyssesHeads"], r
        assert r["measured"] == r["planned"], (seq, mode, r)


def test_tensor_parallel_ranks_keep_what_the_plan_counts(kept) -> None:
    results = kept["tp"]
    for (sp, mode), r in zip(CASES, results.values(), strict=True):
        assert r["measured"] == r["planned"], (sp, mode, r)


def test_ulysses_dense_blocks_keep_what_the_plan_counts(kept) -> None:
    """The dense attention under Ulysses keeps its exchanged output beside SDPA's (the plan's e·q per token)."""
    r = kept["dense_cp"]
    assert r["measured"] == r["planned"], r
