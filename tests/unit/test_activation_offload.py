"""The activation-offload hooks move exactly the bytes the plan's host line says, and nothing stays behind.

On CPU the hooks keep each tensor in place (host and device are the same memory), but they run and
count every storage they would copy: that count is checked against `plan.offload` for every
checkpointing mode, in fp32 and under bf16 autocast, on the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from dtlaunch.config.compose import compose
from dtlaunch.config.validate import validate
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.offload import HOST_ACTIVATIONS
from dtlaunch.train.offload_activations import apply_activation_offload, is_weight
from dtlaunch.train.parallel.ac import apply_ac
from dtlaunch.train.parallel.init_weights import materialize_and_init
from dtlaunch.train.parallel.parallelize import compute_context
from dtlaunch.train.parallel.tensor_parallel import cross_entropy

BASE = ["launch.nproc_per_node=1", "training.activation_offload=true", "model=tiny", "training.seq_len=64"]
MODES = [
    ["training.activation_checkpointing=none"],
    ["training.activation_checkpointing=full"],
    ["training.activation_checkpointing=selective"],
    ["training.activation_checkpointing=selective", "training.ac_policy=layer"],
    ["precision=bf16"],
]


def _step(overrides: list[str]) -> tuple[dict, float, torch.Tensor]:
    cfg = compose([*BASE, "training.micro_batch=2", *overrides]).cfg
    plan = plan_memory(cfg, validate(cfg).layout)
    cpu = torch.device("cpu")
    model = model_spec(cfg.model).build(cfg.model, rope_len=64, device="meta")
    apply_ac(model, cfg.training)
    off = apply_activation_offload(model, cpu)
    materialize_and_init(model, cpu, 1, init_source=model)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 65), generator=torch.Generator().manual_seed(0))
    with compute_context([model], cfg, cpu):
        logits = model(tokens[:, :-1])
    loss = cross_entropy(logits, tokens[:, 1:])
    held_after_forward = off.held_bytes
    loss.backward()
    counts = {"packed": off.packed_bytes, "held_fwd": held_after_forward, "held_end": off.held_bytes}
    return counts, plan.worst.host[HOST_ACTIVATIONS], loss.detach()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(x.split("=")[1] for x in m))
def test_packed_bytes_are_the_planned_host_bytes(mode: list[str]) -> None:
    counts, planned, _ = _step(mode)
    assert counts["packed"] == planned, (counts, planned)
    assert counts["held_fwd"] == planned  # after forward every moved byte is on the host ...
    assert counts["held_end"] == 0  # ... and after backward every one came back


def test_weights_are_not_offloaded() -> None:
    w = torch.nn.Parameter(torch.ones(4, 4))
    h = torch.ones(2, 4, requires_grad=True) * 2  # an activation: computed, not a leaf
    assert is_weight(w) and is_weight(w.t()) and is_weight(w.to(torch.bfloat16).t())
    assert not is_weight(h.view(8)) and not is_weight(h.t()) and not is_weight(h.to(torch.bfloat16))
