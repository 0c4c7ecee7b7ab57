"""The activation-offload hooks move exactly the bytes the plan's host line says, and nothing stays behind.

On CPU the hooks keep each tensor in place (host and device are the same memory), but they run and
count every storage they would copy: that count is checked against `plan.offload` for every
checkpointing mode, in fp32 and under bf16 autocast, on the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.lines import Line
from dtlaunch.plan.memory import plan_memory
from dtlaunch.train.features.offload_activations import apply_activation_offload, is_weight
from dtlaunch.train.loss import cross_entropy
from dtlaunch.train.parallel.ac import apply_ac
from dtlaunch.train.parallel.init_weights import materialize_and_init
from dtlaunch.train.parallel.parallelize import apply_compile, compute_context

BASE = ["launch.nproc_per_node=1", "training.activation_offload=true", "model=tiny", "training.seq_len=64"]
MODES = [
    ["training.activation_checkpointing=none"],
    ["training.activation_checkpointing=full"],
    ["training.activation_checkpointing=selective"],
    ["training.activation_checkpointing=selective", "training.ac_policy=layer"],
    ["precision=bf16"],
    ["precision=bf16", "precision.residual_dtype=bf16"],
    ["precision=bf16", "precision.residual_dtype=bf16", "training.activation_checkpointing=full"],
    ["precision=bf16", "precision.residual_dtype=bf16", "training.activation_checkpointing=selective"],
]


def _step(overrides: list[str], offload: bool = True, copy: bool = False) -> tuple[dict, float, torch.Tensor, list]:
    cfg = compose([*BASE, "training.micro_batch=2", *overrides]).cfg
    decisions = validate(cfg).decisions
    layout = decisions.layout
    plan = plan_memory(cfg, layout)
    cpu = torch.device("cpu")
    model = model_spec(cfg.model).build(cfg.model, rope_len=64, device="meta")
    if decisions.residual_in_compute_dtype:
        model.keep_residual_in(torch.bfloat16)
    apply_ac(model, cfg.training)
    off = apply_activation_offload(model, cpu, copy=copy) if offload else None
    materialize_and_init(model, cpu, 1, init_source=model)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 65), generator=torch.Generator().manual_seed(0))
    with compute_context([model], cfg, cpu):
        logits = model(tokens[:, :-1])
    loss = cross_entropy(logits, tokens[:, 1:])
    held_after_forward = off.held_bytes if off else 0
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if off is None:
        return {}, 0.0, loss.detach(), grads
    counts = {"packed": off.packed_bytes, "held_fwd": held_after_forward, "held_end": off.held_bytes}
    return counts, plan.worst.host[Line.HOST_ACTIVATIONS], loss.detach(), grads


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(x.split("=")[1] for x in m) + f"-{len(m)}")
def test_packed_bytes_are_the_planned_host_bytes(mode: list[str]) -> None:
    counts, planned, _, _ = _step(mode)
    assert counts["packed"] == planned, (counts, planned)
    assert counts["held_fwd"] == planned  # after forward every moved byte is on the host ...
    assert counts["held_end"] == 0  # ... and after backward every one came back


@pytest.mark.parametrize("mode", [MODES[0], MODES[1], MODES[4]], ids=["none", "full", "bf16"])
def test_copied_storages_rebuild_every_saved_tensor_exactly(mode: list[str]) -> None:
    """copy=True: each storage is copied and the saved views are rebuilt from the copy in backward (the
    CUDA path's bookkeeping, without streams): the loss and every gradient equal those without offload."""
    _, _, loss, grads = _step(mode, offload=False)
    counts, planned, loss_off, grads_off = _step(mode, copy=True)
    assert counts["packed"] == planned and counts["held_end"] == 0
    assert torch.equal(loss, loss_off)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_off, strict=True))


def test_weights_are_not_offloaded() -> None:
    w = torch.nn.Parameter(torch.ones(4, 4))
    h = torch.ones(2, 4, requires_grad=True) * 2  # an activation: computed, not a leaf
    assert is_weight(w) and is_weight(w.t()) and is_weight(w.to(torch.bfloat16).t())
    assert not is_weight(h.view(8)) and not is_weight(h.t()) and not is_weight(h.to(torch.bfloat16))


def test_views_at_an_offset_are_rebuilt_from_the_copied_storage() -> None:
    """Two saved views of one storage at different offsets: one copy, both rebuilt where they were."""
    from dtlaunch.train.features.offload_activations import ActivationOffloader

    def grads(off: ActivationOffloader | None) -> tuple:
        a = torch.arange(12.0).view(3, 4).requires_grad_()
        h = a * 1.5  # an activation whose storage both views share
        hooks = torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack) if off else torch.enable_grad()
        with hooks:
            y = (h[:, 1:] * h[:, :3]).sum()
        y.backward()
        return a.grad, off.packed_bytes if off else 0

    off = ActivationOffloader(device=torch.device("cpu"), copy=True)
    want, _ = grads(None)
    got, packed = grads(off)
    assert torch.equal(want, got)
    assert packed == 12 * 4  # the shared storage, once


def _compiled_step(offload: bool) -> tuple[torch.Tensor, list, int, float]:
    """One fp32 step of the tiny model under full AC and compile, blocks compiled as parallelize compiles
    them: the whole checkpointed block without offload, the block inside its checkpoint with it."""
    cfg = compose(["launch.nproc_per_node=1", "model=tiny", "training.seq_len=64", "training.micro_batch=2"]).cfg
    cfg.training.activation_checkpointing, cfg.training.compile = "full", True
    cfg.training.activation_offload = offload
    plan = plan_memory(cfg, validate(cfg).layout)
    cpu = torch.device("cpu")
    model = model_spec(cfg.model).build(cfg.model, rope_len=64, device="meta")
    apply_ac(model, cfg.training)
    off = apply_activation_offload(model, cpu, copy=True) if offload else None
    apply_compile(model, inside_checkpoint=offload)
    materialize_and_init(model, cpu, 1, init_source=model)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 65), generator=torch.Generator().manual_seed(0))
    with compute_context([model], cfg, cpu):
        logits = model(tokens[:, :-1])
    loss = cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    packed = off.packed_bytes if off else 0
    return (
        loss.detach(),
        [p.grad.clone() for p in model.parameters()],
        packed,
        plan.worst.host.get(Line.HOST_ACTIVATIONS, 0),
    )


@pytest.mark.slow_reason("two torch.compile builds (inductor on CPU) of a model step: with and without offload")
def test_offload_with_compile_matches_compile_without_offload() -> None:
    """training.activation_offload with training.compile: the checkpointed block inputs go through the hooks
    outside the compiled blocks (copied, as on CUDA) and the loss and every gradient are bit-identical to the
    compiled run without offload (fp32); the bytes moved are the plan's host line."""
    loss, grads, _, _ = _compiled_step(offload=False)
    loss_off, grads_off, packed, planned = _compiled_step(offload=True)
    assert packed > 0 and packed == planned, (packed, planned)
    assert torch.equal(loss, loss_off)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_off, strict=True))
