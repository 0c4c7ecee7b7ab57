"""precision.residual_dtype=bf16: under autocast the residual stream between the blocks is bf16 (the fp32
embedding output cast once, the norms return it), the loss stays close to the fp32 stream's, and the plan
halves exactly what full activation checkpointing keeps per block. The saved bytes of every AC mode are
checked against the plan in tests/unit/test_activation_offload.py."""

from __future__ import annotations

import torch

from dtlaunch.commands.common import load_job
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.memory import plan_memory
from dtlaunch.train.loss import cross_entropy
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _step(residual_bf16: bool) -> tuple[torch.Tensor, set, list]:
    cfg = compose(["model=tiny", "training.seq_len=64"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=64, device="meta")
    materialize_and_init(model, torch.device("cpu"), 1, init_source=model)
    if residual_bf16:
        model.keep_residual_in(torch.bfloat16)
    seen: set = set()
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    return loss.detach(), seen, [p.grad for p in model.parameters()]


def test_bf16_residual_stream_under_autocast() -> None:
    loss32, seen32, grads32 = _step(False)
    loss16, seen16, grads16 = _step(True)
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}
    assert not torch.equal(loss32, loss16)  # the stream really is rounded ...
    assert torch.allclose(loss16, loss32, rtol=1e-2)  # ... by about bf16's precision
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads16)  # fp32 master gradients


def test_plan_keeps_half_the_block_inputs() -> None:
    # Offload off: the block inputs stay on the GPU, where the activations line counts them.
    args = [
        "recipe=llama3_8b_qlora",
        "training.micro_batch=1",
        "training.global_batch=1",
        "training.seq_len=8192",
        "training.activation_offload=false",
        "training.loss_chunks=8",  # the same loss both ways: auto takes the full pass where it fits (bf16 only)
    ]
    plans = {}
    for r in ("auto", "bf16"):
        job = load_job([*args, f"precision.residual_dtype={r}"])
        plans[r] = plan_memory(job.cfg, job.layout)
    m = job.cfg.model
    saved = int(m.n_layers) * 2 * int(m.dim) * 8192  # fp32 -> bf16 block inputs, full AC
    drop = plans["auto"].worst.lines["activations"] - plans["bf16"].worst.lines["activations"]
    assert drop >= saved and plans["bf16"].peak < plans["auto"].peak
