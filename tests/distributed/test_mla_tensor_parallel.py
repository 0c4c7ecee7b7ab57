"""DeepSeek-V3's latent attention split by heads over 2 forked gloo ranks (dtlaunch/models/deepseek_v3/tp_plan.py)
trains as one process: the losses and grad norms of every step within 1e-4, and every gradient of the first
step (gathered from its shards) within 1e-5 of its largest entry, so each gradient, not only their norm, is
the one process's. With a low-rank query and without, with values narrower than q/k (padded for SDPA, mla.py) and as
wide, with sequence parallel and without, under FSDP2 x TP (4 ranks: the whole low-rank projections
plain tensors beside the heads' DTensors), and pipeline x TP with sequence parallel (4 ranks, strategy=3d:
one block per stage; the first stage's gradients compared). A dense first block and a sparse one with a shared expert: the
MoE family's TP of the FFNs runs too.

LoRA on the same TP cells (in the same forked group): the family's default targets (the MLP's linears of the
dense block and the shared expert, o_proj, and deepseek's q_b_proj / kv_b_proj, the per-head projections) and
all-linear (the whole low-rank q_a_proj / kv_a_proj_with_mqa too): losses and grad norms as above, every
adapter's gradient of the second step (at the first, lora_b = 0 leaves lora_a's zero) the one process's, and
no other parameter with one.

Float8 (tensorwise, emulated) on a TP cell of the same group, with widths that are all multiples of 16 so every
latent-attention linear is converted (torchao's float8 styles on the heads' projections, the whole low-rank
ones float8 too): losses within test_float8.py's bounds of one process with float8 and of bf16. Without
sequence parallel: under it torchao all-gathers float8 activations, which gloo cannot (refused in one line)."""

from __future__ import annotations

import importlib.util

import pytest
from forked_training import run_forked, train
from tiny_models import DEEPSEEK_V3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason(
        "a forked group of 2 trains 4 TP layouts, 2 LoRA x TP ones and float8 x TP, one of 4 FSDP2 x TP and "
        "pipeline x TP"
    ),
]

STEPS = 3
TOL = 1e-4
GRAD_TOL = 1e-5
SMALL = [
    *DEEPSEEK_V3,
    "hardware=cpu",
    "precision=fp32",
    "training.seq_len=32",
    "training.micro_batch=4",
    "training.global_batch=4",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.grad_clip=0.5",
]
# name -> (q_lora_rank, v_head_dim, sequence parallel)
CASES = {
    "low_rank_q_padded_v_sp": (24, 10, True),
    "low_rank_q_padded_v_no_sp": (24, 10, False),
    "plain_q_padded_v_sp": ("null", 10, True),
    "low_rank_q_v_as_wide_as_qk_sp": (24, 20, True),
}
# name -> (peft overrides on the low-rank query's sequence-parallel cell, the linears they adapt); alpha so
# the adapters move the loss. The default: the MLP's (dense block, shared expert), o_proj, and deepseek's own
# q_b_proj / kv_b_proj (split by heads); all-linear adds the whole low-rank wq_a / wkv_a and the router.
LORA = {
    "lora_default_targets_sp": (["peft=lora", "peft.alpha=32"], {"wq_b", "wkv_b", "wo", "w1", "w2", "w3"}),
    "lora_all_linear_sp": (
        ["peft=lora", "peft.alpha=32", "peft.targets=[all-linear]"],
        {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3", "gate"},
    ),
}
# FSDP2 over 2 data-parallel ranks x TP 2, each rank's micro-batch of 2: the one-process batch of 4.
FSDP_TP = ["strategy=fsdp_tp", "launch.nproc_per_node=4", "training.micro_batch=2"]
# Pipeline x TP with sequence parallel (strategy=3d at 4 ranks: pp 2 x tp 2): the dense first block on
# stage 0, the sparse one on stage 1, each split by heads; the batch of 4 in the pipeline's micro-batches.
PP_TP = ["strategy=3d", "launch.nproc_per_node=4", "training.micro_batch=4"]
# The 4-rank group's cells: name -> layout overrides.
FOUR_RANKS = {"fsdp_tp": FSDP_TP, "pp2_tp2_sp": PP_TP}
# Float8 x TP: widths that are all multiples of 16 (torchao converts only those linears): q 32-rank, a 16-wide
# kv latent, 16 + 16 query / key dims per head, 16-wide values.
FLOAT8_WIDTHS = [
    "model.q_lora_rank=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=16",
    "model.qk_rope_head_dim=16",
    "model.v_head_dim=16",
]
FLOAT8 = ["precision=bf16", "precision.float8=tensorwise", "precision.float8_emulate=true"]
FLOAT8_TP = ["strategy=tp", "launch.nproc_per_node=2", "strategy.sequence_parallel=false"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _model(q_rank, v_dim, peft: tuple[str, ...] = ()) -> list[str]:
    return [*SMALL, f"model.q_lora_rank={q_rank}", f"model.v_head_dim={v_dim}", *peft]


def _tp(q_rank, v_dim, sp: bool, peft: tuple[str, ...] = ()) -> list[str]:
    tp = ["strategy=tp", "launch.nproc_per_node=2", f"strategy.sequence_parallel={str(sp).lower()}"]
    return [*_model(q_rank, v_dim, peft), *tp]


def _case(name: str) -> tuple:
    """(q_lora_rank, v_head_dim, sequence parallel, peft overrides) of a cell."""
    if name in LORA:
        return (24, 10, True, tuple(LORA[name][0]))
    return (*CASES.get(name, (24, 10, True)), ())


def _record_first_grads(rt, _batches) -> None:
    """Before the first optimizer step, every gradient (gathered whole from its shards); a parameter without
    one (LoRA's frozen base) is left out. Under LoRA before the second step: at the first, every lora_a's
    gradient is zero (lora_b starts at zero), which would compare nothing."""
    from torch.distributed.tensor import DTensor

    at = 1 if str(rt.cfg.peft.method) == "none" else 2
    calls = []

    def record(*_) -> None:
        calls.append(None)
        if len(calls) == at:
            rt.first_grads = {}
            for name, p in rt.model_parts[0].named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                rt.first_grads[name.replace("_checkpoint_wrapped_module.", "")] = g.flatten().tolist()

    rt.optimizers[0].register_step_pre_hook(record)


def _run(overrides: list[str], world: int) -> dict:
    return train(overrides, world, STEPS, inspect=lambda rt: rt.first_grads, prepare=_record_first_grads)


def _float8_linears(rt) -> list[str]:
    return sorted(n for n, m in rt.model_parts[0].named_modules() if type(m).__name__ == "Float8Linear")


def _run_float8(extra: list[str], world: int) -> dict:
    """The float8 cell: one process converts its meta model as the workers' runtime does."""
    import torch

    from dtlaunch.train.parallel.float8 import apply_float8

    convert = lambda m, cfg: apply_float8(m, cfg.precision, torch.device("cpu"))  # noqa: E731
    return train([*SMALL, *FLOAT8_WIDTHS, *extra], world, STEPS, inspect=_float8_linears, convert=convert)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    def run_all() -> dict:
        out = {name: _run(_tp(*_case(name)), 2) for name in [*CASES, *LORA]}
        if HAS_TORCHAO:
            out["float8_tensorwise_tp"] = _run_float8([*FLOAT8, *FLOAT8_TP], 2)
        return out

    return run_forked(2, run_all, tmp_path_factory.mktemp("mla_tp") / "results.json")


@pytest.fixture(scope="module")
def launched_four(tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {name: _run([*_model(24, 10), *layout], 4) for name, layout in FOUR_RANKS.items()}

    return run_forked(4, run_all, tmp_path_factory.mktemp("mla_four_ranks") / "results.json")


@pytest.mark.parametrize("name", [*CASES, *LORA, *FOUR_RANKS])
def test_tensor_parallel_latent_attention_trains_as_one_process(name: str, request) -> None:
    from dtlaunch.models.lora import is_adapter

    q_rank, v_dim, _, peft = _case(name)
    got = request.getfixturevalue("launched_four" if name in FOUR_RANKS else "launched")[name]
    want = _run([*_model(q_rank, v_dim, peft), "launch.nproc_per_node=1"], 1)
    assert want["loss"][-1] < want["loss"][0], want  # the steps move the weights
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g}: {got[key]} vs {want[key]}"
    if name == "pp2_tp2_sp":  # rank 0 holds the first stage: its blocks' gradients, the embedding's
        assert got["inspect"] and "layers.1" not in " ".join(got["inspect"]), sorted(got["inspect"])
        want["inspect"] = {k: v for k, v in want["inspect"].items() if k in got["inspect"]}
    assert got["inspect"].keys() == want["inspect"].keys()
    if peft:  # only the adapters have gradients, on the linears the targets name
        adapted = {n.rsplit(".", 2)[-2] for n in want["inspect"]}
        assert all(is_adapter(n) for n in want["inspect"]) and adapted == LORA[name][1], adapted
    for param, g in want["inspect"].items():
        scale = max(abs(x) for x in g)
        diff = max(abs(a - b) for a, b in zip(got["inspect"][param], g, strict=True))
        assert scale > 0 and diff <= GRAD_TOL * scale, f"{param}: max abs diff {diff:.3g}, largest entry {scale:.3g}"


@pytest.mark.skipif(not HAS_TORCHAO, reason="float8 needs torchao")
def test_float8_tensor_parallel_latent_attention_trains_as_one_process(launched) -> None:
    from test_float8 import BF16_TOL, LOSS_TOL

    got = launched["float8_tensorwise_tp"]
    want = _run_float8([*FLOAT8, "launch.nproc_per_node=1"], 1)
    plain = train([*SMALL, *FLOAT8_WIDTHS, "precision=bf16", "launch.nproc_per_node=1"], 1, STEPS)
    # Every block linear but the router's gate (8 x 64: 8 experts, not a multiple of 16) is float8, the latent
    # attention's included, under TP as on one process.
    attention = {f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")}
    assert got["inspect"] == want["inspect"] and attention <= set(want["inspect"]), want["inspect"]
    assert want["loss"][-1] < want["loss"][0], want
    diff = max(abs(a - b) for a, b in zip(got["loss"], want["loss"], strict=True))
    assert diff <= LOSS_TOL, f"float8 TP against one process: {diff:.3g}: {got['loss']} vs {want['loss']}"
    diff = max(abs(a - b) for a, b in zip(want["loss"], plain["loss"], strict=True))
    assert diff <= BF16_TOL, f"float8 against bf16: {diff:.3g}: {want['loss']} vs {plain['loss']}"


def test_float8_tensor_parallel_with_sequence_parallel_on_gloo_is_one_line() -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    sp = [*SMALL, *FLOAT8_WIDTHS, *FLOAT8, "strategy=tp", "launch.nproc_per_node=2", "strategy.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"^precision.float8=tensorwise with strategy.sequence_parallel=true .*gloo"):
        validate(compose(sp).cfg)
