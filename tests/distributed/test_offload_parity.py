"""Offloading changes where tensors live, never the numbers: 2-process gloo runs with
`strategy.cpu_offload` (FSDP2's CPUOffloadPolicy) and `training.activation_offload` (saved-tensor hooks)
against the same layouts without them, bit for bit, with gradient clipping active at every step and
two accumulation micro-steps (both broke once in torchtune: #1977, #1941), and tensor parallel under
activation offload (torchtune #2683: side streams with TP gave wrong losses).

On CPU the offload "host" is the same memory: these runs prove the mechanics (the hooks run, FSDP's
offload path copies shards and steps on the host) keep the numerics; they cannot show the GPU's streams.
"""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

STEPS = 3
# Two micro-steps of 2 samples per rank (global batch 8), clipping at 0.05 (every step's norm is larger).
COMMON = [
    "training.seq_len=32",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.grad_clip=0.05",
    "training.micro_batch=2",
    "training.global_batch=8",
    "launch.nproc_per_node=2",
]
PAIRS: dict[str, tuple[list[str], list[str]]] = {
    # name -> (layout, the switch under test)
    "cpu_offload_zero3": (["recipe=tiny_fsdp", "strategy=zero3"], ["strategy.cpu_offload=true"]),
    "cpu_offload_zero2": (["recipe=tiny_fsdp", "strategy=zero2"], ["strategy.cpu_offload=true"]),
    "act_offload_tp": (["recipe=tiny_tp", "training.global_batch=2"], ["training.activation_offload=true"]),
    # The same with every saved storage copied and the DTensors rebuilt from the copies (the CUDA path's
    # bookkeeping; dtlaunch.train.features.offload_activations copy=True).
    "act_offload_tp_copy": (["recipe=tiny_tp", "training.global_batch=2"], ["training.activation_offload=true"]),
    "act_offload_zero3_full_ac": (
        ["recipe=tiny_fsdp", "strategy=zero3", "training.activation_checkpointing=full"],
        ["training.activation_offload=true"],
    ),
}


def _inspect(rt) -> dict:
    """Bytes the activation hooks packed, and whether FSDP really keeps its shards on the host."""
    model = rt.model_parts[0]
    off = getattr(getattr(model, "module", model), "activation_offloader", None)
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    group = state._fsdp_param_group if state is not None else None
    params = list(group.fsdp_params) if group is not None else []
    return {"packed": off.packed_bytes if off else 0, "offloaded": bool(params) and params[0].offload_to_cpu}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    def run_all() -> dict:
        import functools
        from unittest import mock

        from dtlaunch.train.features import offload_activations

        out = {}
        for name, (layout, switch) in PAIRS.items():
            out[name] = train([*COMMON, *layout], 2, STEPS)
            copy = functools.partial(offload_activations.apply_activation_offload, copy=name.endswith("_copy"))
            with mock.patch.object(offload_activations, "apply_activation_offload", copy):
                out[name + "+offload"] = train([*COMMON, *layout, *switch], 2, STEPS, inspect=_inspect)
        return out

    return run_forked(2, run_all, tmp_path_factory.mktemp("offload") / "results.json")


@pytest.mark.parametrize("name", list(PAIRS))
def test_offload_is_bit_exact(name: str, results: dict) -> None:
    plain, offloaded = results[name], results[name + "+offload"]
    assert len(offloaded["loss"]) == STEPS
    assert offloaded["loss"] == plain["loss"], (name, plain, offloaded)
    assert offloaded["grad_norm"] == plain["grad_norm"], (name, plain, offloaded)
    assert min(plain["grad_norm"]) > 0.05  # clipping scaled every step's gradients
    assert plain["loss"][-1] < plain["loss"][0]  # the updates moved the loss
    if "act_offload" in name:
        assert offloaded["inspect"]["packed"] > 0  # the hooks really packed the blocks' saved tensors
    else:
        assert offloaded["inspect"]["offloaded"]  # FSDP's CPUOffloadPolicy is in force


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """CPU offload on one rank (FSDP over a 1-rank mesh only to keep the state on the host) against the
    plain one-process run: 4 accumulation micro-steps, clipping at every step."""
    one = [*COMMON[:-1], "recipe=tiny_fsdp", "launch.nproc_per_node=1"]

    def run_all() -> dict:
        return {
            "plain": train([*one, "strategy=ddp"], 1, STEPS),
            "offload": train(
                [*one, "strategy=zero3", "strategy.cpu_offload=true"], 1, STEPS, inspect=_inspect, mesh=True
            ),
        }

    return run_forked(1, run_all, tmp_path_factory.mktemp("offload1") / "results.json")


def test_cpu_offload_on_one_rank_is_bit_exact(one_rank: dict) -> None:
    plain, offloaded = one_rank["plain"], one_rank["offload"]
    assert offloaded["inspect"]["offloaded"]  # FSDP2 really holds the parameters on the host
    assert offloaded["loss"] == plain["loss"], one_rank
    assert offloaded["grad_norm"] == plain["grad_norm"], one_rank
    assert min(plain["grad_norm"]) > 0.05 and plain["loss"][-1] < plain["loss"][0]
