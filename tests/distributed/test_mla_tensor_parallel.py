"""DeepSeek-V3's latent attention split by heads over 2 forked gloo ranks (dtlaunch/models/deepseek_v3/tp_plan.py)
trains as one process: the losses and grad norms of every step within 1e-4, and every gradient of the first
step (gathered from its shards) within 1e-5 of its largest entry, so each gradient, not only their norm, is
the one process's. With a low-rank query and without, with values narrower than q/k (padded for SDPA, mla.py) and as
wide, with sequence parallel and without, and under FSDP2 x TP (4 ranks: the whole low-rank projections
plain tensors beside the heads' DTensors). A dense first block and a sparse one with a shared expert: the
MoE family's TP of the FFNs runs too."""

from __future__ import annotations

import pytest
from forked_training import run_forked, train
from tiny_models import DEEPSEEK_V3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason("a forked group of 2 trains 4 TP layouts, one of 4 FSDP2 x TP"),
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
# FSDP2 over 2 data-parallel ranks x TP 2, each rank's micro-batch of 2: the one-process batch of 4.
FSDP_TP = ["strategy=fsdp_tp", "launch.nproc_per_node=4", "training.micro_batch=2"]


def _model(q_rank, v_dim) -> list[str]:
    return [*SMALL, f"model.q_lora_rank={q_rank}", f"model.v_head_dim={v_dim}"]


def _tp(q_rank, v_dim, sp: bool) -> list[str]:
    tp = ["strategy=tp", "launch.nproc_per_node=2", f"strategy.sequence_parallel={str(sp).lower()}"]
    return [*_model(q_rank, v_dim), *tp]


def _record_first_grads(rt, _batches) -> None:
    """Before the first optimizer step, every parameter's whole gradient (gathered from its shards)."""
    from torch.distributed.tensor import DTensor

    def record(*_) -> None:
        if not hasattr(rt, "first_grads"):
            rt.first_grads = {}
            for name, p in rt.model_parts[0].named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                rt.first_grads[name.replace("_checkpoint_wrapped_module.", "")] = g.flatten().tolist()

    rt.optimizers[0].register_step_pre_hook(record)


def _run(overrides: list[str], world: int) -> dict:
    return train(overrides, world, STEPS, inspect=lambda rt: rt.first_grads, prepare=_record_first_grads)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {name: _run(_tp(*case), 2) for name, case in CASES.items()}

    return run_forked(2, run_all, tmp_path_factory.mktemp("mla_tp") / "results.json")


@pytest.fixture(scope="module")
def launched_fsdp_tp(tmp_path_factory) -> dict:
    def run_all() -> dict:
        return _run([*_model(24, 10), *FSDP_TP], 4)

    return run_forked(4, run_all, tmp_path_factory.mktemp("mla_fsdp_tp") / "results.json")


@pytest.mark.parametrize("name", [*CASES, "fsdp_tp"])
def test_tensor_parallel_latent_attention_trains_as_one_process(name: str, request) -> None:
    q_rank, v_dim, _ = CASES.get(name, (24, 10, True))
    got = request.getfixturevalue("launched_fsdp_tp" if name == "fsdp_tp" else "launched")
    got = got if name == "fsdp_tp" else got[name]
    want = _run([*_model(q_rank, v_dim), "launch.nproc_per_node=1"], 1)
    assert want["loss"][-1] < want["loss"][0], want  # the steps move the weights
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g}: {got[key]} vs {want[key]}"
    assert got["inspect"].keys() == want["inspect"].keys()
    for param, g in want["inspect"].items():
        scale = max(abs(x) for x in g)
        diff = max(abs(a - b) for a, b in zip(got["inspect"][param], g, strict=True))
        assert scale > 0 and diff <= GRAD_TOL * scale, f"{param}: max abs diff {diff:.3g}, largest entry {scale:.3g}"
