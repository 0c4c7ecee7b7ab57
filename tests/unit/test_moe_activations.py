"""The planner's saved-activation bytes of MoE blocks against what the runtime keeps: a small MoE decoder
with the runtime's activation checkpointing, every tensor storage counted by the runtime's StorageCounter
from the first block's input to the last block's output (= what the blocks keep for backward)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.models.moe import activations as act
from dtlaunch.models.moe import experts
from dtlaunch.models.moe.model import build_model
from dtlaunch.train.observe.memtrack import StorageCounter
from dtlaunch.train.parallel.ac import apply_ac

BATCH, SEQ = 2, 64


def _kept_by_blocks(overrides: list[str], mode: str, grouped: bool = False) -> tuple[float, float]:
    m = load_job(["model=planner_moe", "model.n_layers=2", *overrides]).cfg.model
    torch.manual_seed(0)
    model = build_model(m, rope_len=SEQ, device="cpu")
    model.init_weights(0)
    apply_ac(model, SimpleNamespace(activation_checkpointing=mode, ac_memory_budget=0.0, ac_policy="op"))
    counter = StorageCounter()
    counter.add_existing([*model.parameters(), *model.buffers()])
    marks: list[int] = []
    first, last = model.layers["0"], model.layers[str(m.n_layers - 1)]
    first.register_forward_pre_hook(lambda *_: marks.append(counter.live))
    last.register_forward_hook(lambda *_: marks.append(counter.live))
    with counter:
        model(torch.randint(0, m.vocab_size, (BATCH, SEQ)))
    # Block 0's input existed before the first mark; the last block's output is the next one's input.
    measured = marks[-1] - marks[0]
    d = dataclasses.replace(act.BlockDims.of(m), grouped=grouped)
    predicted = act.block_bytes(d, 4, mode) * BATCH * SEQ * m.n_layers
    return measured, predicted


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
@pytest.mark.parametrize(
    "mode,shared", [("none", []), ("selective", []), ("selective", ["model.moe.num_shared_experts=1"])]
)
def test_block_bytes_match_what_the_runtime_keeps(
    mode: str, shared: list[str], grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both expert kernels: the per-expert loop (torch without a CPU grouped GEMM) and torch._grouped_mm."""
    if grouped and torch.float32 not in experts.cpu_grouped_mm_dtypes():
        pytest.skip("torch._grouped_mm has no CPU kernel here")
    if not grouped:
        monkeypatch.setattr(experts, "cpu_grouped_mm_dtypes", lambda: frozenset())
    measured, predicted = _kept_by_blocks(shared, mode, grouped)
    if grouped and mode == "none":
        # The grouped GEMM also keeps its int32 group offsets (4 B per expert and block, not per token).
        assert measured - predicted == 4 * 8 * 2
        return
    # Selective: the experts' saved outputs alternate by expert, so the exact figure depends on how the
    # router splits the tokens; the planner assumes a balanced split.
    assert predicted == pytest.approx(measured, rel=0.02 if mode == "selective" else 1e-6)


# gpt-oss's parts on the planner_moe shape: sinks, biased q/k/v/o, router and experts, the clamped SwiGLU.
GPT_OSS = ["model.arch=gpt_oss", "model.moe.expert_dim=null", "model.ffn_dim=256", "model.qkv_bias=true"]


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_gpt_oss_block_bytes_match_what_the_runtime_keeps(
    mode: str, grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink kernel's widened SDPA operands and wo's copy of its output, the clamped SwiGLU's seven F-wide
    tensors per copy and the grouped kernel's expert index: the planner's terms, bar the sink kernel's one
    extra row (the dummy query and the sink key: 1/seq of its operands, which the planner leaves out)."""
    if grouped and torch.float32 not in experts.cpu_grouped_mm_dtypes():
        pytest.skip("torch._grouped_mm has no CPU kernel here")
    if not grouped:
        monkeypatch.setattr(experts, "cpu_grouped_mm_dtypes", lambda: frozenset())
    measured, predicted = _kept_by_blocks(GPT_OSS, mode, grouped)
    a, kv, w, e, blocks = 8, 4, 32 + 8, 4, 2  # heads, kv heads, widened head dim, fp32, blocks
    row = e * (2 * a * w + 2 * kv * w) + 4 * a if mode == "none" else e * a * w + 4 * a
    extra = row * BATCH * blocks
    if grouped and mode == "none":
        assert measured - predicted - extra == 4 * 8 * 2  # the grouped GEMM's int32 group offsets
        return
    assert predicted + extra == pytest.approx(measured, rel=0.02 if mode == "selective" else 1e-6)
