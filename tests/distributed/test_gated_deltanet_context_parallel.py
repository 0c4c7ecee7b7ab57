"""The Gated DeltaNet hybrids under context parallel as Ulysses (strategy.cp=2, strategy.cp_style=ulysses) over
2 forked gloo ranks train as one process. Each rank holds the loader's load-balanced chunks of every sequence;
around each linear block's convolution and chunked rule an all-to-all gives it the whole sequence, in order,
of one key head and its two value heads (dtlaunch/models/qwen3_next/gated_deltanet.py `_mix_exchanged`,
train/parallel/ulysses.py `UlyssesHeads`), and the gated full-attention blocks run the dense attention's
Ulysses exchange. training.seq_len=96: the rule's 64-token chunk boundary falls inside the exchanged whole
sequence (rank 0's own chunks are tokens 0-23 and 72-95). Losses and grad norms of every step within 1e-4,
every gradient of the first step within 1e-5 of its largest entry plus the TP test's fp32 noise floor, the
linear block's (its projections, conv1d, A_log / dt_bias, the gated norm, out_proj) included. A third group of
4 ranks crosses it with tensor parallel (tp=2 x cp=2: each TP rank's key heads split again over CP).

Reuses test_gated_deltanet_tensor_parallel.py's cases' helpers and test_mla_tensor_parallel.py's recording of
the first gradients."""

from __future__ import annotations

import pytest
from forked_training import run_forked, train
from test_gated_deltanet_tensor_parallel import LINEAR, NOISE, SMALL
from test_mla_tensor_parallel import GRAD_TOL, TOL, _record_first_grads

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason("a forked group of 2 trains two hybrid families under Ulysses context parallel"),
]

STEPS = 2
SEQ = ["training.seq_len=96"]
CP2 = ["strategy.cp=2", "strategy.cp_style=ulysses", "strategy.dp_shard=1", "launch.nproc_per_node=2"]
FAMILIES = ("qwen3_next", "qwen3_5")


@pytest.fixture(scope="module")
def dirs(tiny_hf_dirs, tiny_moe_hf_dirs) -> dict:
    every = {**tiny_hf_dirs, **tiny_moe_hf_dirs}
    return {family: every[family] for family in FAMILIES}


def _model(path) -> list[str]:
    return [*SMALL, *SEQ, f"model.init_from=hf:{path}"]


def _inspect(rt) -> dict:
    """The first gradients and what runs the token mixing: each linear block's exchange, each attention's."""
    model = rt.model_parts[0]
    exchanges = {type(m.sequence_exchange).__name__ for m in model.modules() if hasattr(m, "sequence_exchange")}
    attention = {type(m.attention_fn).__name__ for m in model.modules() if hasattr(m, "attention_fn")}
    # DDP over the CP ranks (strategy.dp_shard=1) wraps the model: its names under "module.".
    grads = {n.removeprefix("module."): g for n, g in rt.first_grads.items()}
    return {"grads": grads, "mixing": sorted(exchanges | attention)}


def _run(overrides: list[str], world: int) -> dict:
    return train(overrides, world, STEPS, inspect=_inspect, prepare=_record_first_grads)


@pytest.fixture(scope="module")
def launched(dirs, tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {family: _run([*_model(dirs[family]), *CP2], 2) for family in FAMILIES}

    return run_forked(2, run_all, tmp_path_factory.mktemp("gated_deltanet_cp") / "results.json")


@pytest.mark.parametrize("family", FAMILIES)
def test_ulysses_context_parallel_gated_deltanet_trains_as_one_process(family: str, dirs, launched) -> None:
    got = launched[family]
    want = _run([*_model(dirs[family]), "launch.nproc_per_node=1"], 1)
    assert got["inspect"]["mixing"] == ["UlyssesAttention", "UlyssesHeads"]
    assert want["loss"][-1] < want["loss"][0], want  # the steps move the weights
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g}: {got[key]} vs {want[key]}"
    got_grads, want_grads = got["inspect"]["grads"], want["inspect"]["grads"]
    assert got_grads.keys() == want_grads.keys()
    linear = {n.split(".")[3] for n in want_grads if n.startswith("layers.0.attention.")}
    assert linear == set(LINEAR[family]), sorted(linear)
    for param, g in want_grads.items():
        scale = max(abs(x) for x in g)
        diff = max(abs(a - b) for a, b in zip(got_grads[param], g, strict=True))
        assert scale > 0 and diff <= GRAD_TOL * scale + NOISE, (
            f"{param}: max abs diff {diff:.3g}, largest entry {scale:.3g}"
        )


# Tensor parallel x Ulysses context parallel (4 ranks, tp=2 x cp=2): a qwen3_5 decoder of 4 key heads (8 value
# heads) so each TP rank's 2 key heads split again over the 2 CP ranks; the full attention's 4 query heads too.
# Random weights from the seed (no directory): the one process builds the same. FSDP over the CP ranks (DDP
# cannot average over cp with tp).
TP_CP_MODEL = ["model=tiny", "model.arch=qwen3_5", "model.qk_norm=true", "model.n_layers=4"]
TP_CP_MODEL += ["model.linear_num_key_heads=4", "model.linear_num_value_heads=8", "model.linear_key_head_dim=16"]
TP_CP_MODEL += ["model.linear_value_head_dim=16", "model.n_heads=4", "model.n_kv_heads=2"]
TP_CP = ["strategy.tp=2", "strategy.cp=2", "strategy.cp_style=ulysses", "strategy.dp_shard=1", "strategy.zero_stage=3"]
TP_CP += ["launch.nproc_per_node=4"]


@pytest.fixture(scope="module")
def launched_tp_cp(tmp_path_factory) -> dict:
    overrides = [*SMALL, *SEQ, *TP_CP_MODEL, *TP_CP]
    return run_forked(4, lambda: _run(overrides, 4), tmp_path_factory.mktemp("gated_deltanet_tp_cp") / "results.json")


def test_tensor_parallel_by_ulysses_context_parallel_trains_as_one_process(launched_tp_cp) -> None:
    got = launched_tp_cp
    want = _run([*SMALL, *SEQ, *TP_CP_MODEL, "launch.nproc_per_node=1"], 1)
    assert got["inspect"]["mixing"] == ["UlyssesAttention", "UlyssesHeads"]
    assert want["loss"][-1] < want["loss"][0], want
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g}: {got[key]} vs {want[key]}"
