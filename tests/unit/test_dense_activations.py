"""The dense planner's saved-activation bytes per block against what the runtime keeps, per family
variant of the shared decoder (per-head q/k norm, OLMo's post-norm blocks with a whole-projection q/k norm):
the runtime's StorageCounter from the first block's input to the last block's output, one forward."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.models.dense import activations as act
from dtlaunch.models.dense.model import build_model
from dtlaunch.train.observe.memtrack import StorageCounter
from dtlaunch.train.parallel.ac import apply_ac

BATCH, SEQ = 2, 64
FAMILIES = {
    "qwen3": ["model.arch=qwen3", "model.qk_norm=true"],
    "olmo3": ["model.arch=olmo3", "model.qk_norm=true"],
    # Four (1 + w) norms per block, GELU-tanh MLP, q scaled by sqrt(head_dim / query_pre_attn_scalar).
    "gemma3": ["model.arch=gemma3", "model.qk_norm=true", "model.query_pre_attn_scalar=64"],
}


# Where the variants differ: without AC (post-norm and the q/k norm's rsqrt) in each precision, and
# under autocast (fp32 stream, bf16 matmuls) with every AC mode; the per-head variant as the control.
CASES = [
    ("olmo3", "fp32", "none"),
    ("olmo3", "bf16", "none"),
    ("olmo3", "autocast", "none"),
    ("olmo3", "autocast", "selective"),
    ("olmo3", "autocast", "full"),
    ("qwen3", "fp32", "none"),
    ("qwen3", "autocast", "none"),
    ("gemma3", "fp32", "none"),
    ("gemma3", "bf16", "none"),
    ("gemma3", "autocast", "none"),
    ("gemma3", "autocast", "selective"),
    ("gemma3", "autocast", "full"),
]


@pytest.mark.parametrize(("family", "precision", "mode"), CASES)
def test_block_bytes_match_what_the_runtime_keeps(family: str, precision: str, mode: str) -> None:
    m = load_job(["model=tiny", "model.n_layers=2", *FAMILIES[family]]).cfg.model
    model = build_model(m, rope_len=SEQ, device="cpu")
    model.init_weights(0)
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    apply_ac(model, SimpleNamespace(activation_checkpointing=mode, ac_memory_budget=0.0, ac_policy="op"))
    counter = StorageCounter()
    counter.add_existing([*model.parameters(), *model.buffers()])
    marks: list[int] = []
    model.layers["0"].register_forward_pre_hook(lambda *_: marks.append(counter.live))
    model.layers["1"].register_forward_hook(lambda *_: marks.append(counter.live))
    autocast = precision == "autocast"
    with counter, torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        model(torch.randint(0, m.vocab_size, (BATCH, SEQ)))
    # Block 0's input existed before the first mark; the last block's output (the final norm's input,
    # counted by the planner there) is live at the second.
    measured = marks[-1] - marks[0]
    e = 4 if precision == "fp32" else 2
    d = act.BlockDims.of(m)
    predicted = act.block_bytes(d, e, mode, autocast=autocast) * BATCH * SEQ * 2
    if autocast:
        # Autocast's cache of the weights' bf16 casts (the planner's weight-cast line) lives until its exit.
        measured -= 2 * sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers") and p.dim() == 2)
        if d.post_norm and mode == "none":
            # A post-norm block does not keep its fp32 input (its linears save their casts): the last
            # output is the final norm's alone.
            measured -= 4 * d.h * BATCH * SEQ
        if d.sandwich and mode == "none":
            # Gemma's q/k norms return the compute dtype, so each block's RoPE saves its own cast tables:
            # the planner's separate rope-cast line (plan.stage.forward_lines), not a block term.
            predicted += act.rope_cast_bytes(d, e, SEQ) * 2
    assert measured == predicted
