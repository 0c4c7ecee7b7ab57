"""training.loss_chunks: the chunked head + cross-entropy (dtlaunch.train.loss) against plain
torch on full logits, for the loss and the gradients of the hidden states and the head's weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtlaunch.config.decisions import Decisions
from dtlaunch.train.loss import chunked_cross_entropy


def _inputs(seed: int = 0, b: int = 3, s: int = 7, h: int = 16, v: int = 50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).requires_grad_()
    targets = torch.randint(0, v, (b, s), generator=g)
    targets[0, :3] = -100  # masked (chat) targets do not count
    targets[2, -1] = -100
    return hidden, weight, targets


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of a whole tensor (elementwise ratios blow up on near-zero entries in fp32)."""
    return float((got - want).norm() / want.norm())


def _reference(hidden, weight, targets, reduction):
    return F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten(0, 1), reduction=reduction)


@pytest.mark.parametrize("chunks", [1, 2, 5, 8, 64])  # 21 tokens: uneven chunks, more chunks than tokens
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_grads_equal_full_logits(chunks: int, reduction: str) -> None:
    hidden, weight, targets = _inputs()
    want = _reference(hidden, weight, targets, reduction)
    want_gh, want_gw = torch.autograd.grad(want, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, chunks, reduction)
    got_gh, got_gw = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert _rel(got_gh, want_gh) <= 1e-6 and _rel(got_gw, want_gw) <= 1e-6
    assert got_gh[0, :3].abs().max() == 0  # the masked tokens get no gradient


def test_frozen_head_and_no_grad() -> None:
    hidden, weight, targets = _inputs(1)
    weight.requires_grad_(False)  # LoRA: the head is frozen, only the hidden states get a gradient
    want_gh = torch.autograd.grad(_reference(hidden, weight, targets, "mean"), hidden)[0]
    got_gh = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 4), hidden)[0]
    assert _rel(got_gh, want_gh) <= 1e-6
    with torch.no_grad():  # validation: no recompute, the same value
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, weight, targets, 4),
            _reference(hidden, weight, targets, "mean"),
            rtol=1e-6,
            atol=0,
        )


def test_decoder_hidden_states_through_the_runtime_loss() -> None:
    """The tiny model called with the loss's `head` argument (its hidden states): the HeadLoss on them equals
    cross_entropy on its logits."""
    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.loss import cross_entropy, head_loss
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    cfg = compose(["model=tiny", "training.seq_len=16", "training.loss_chunks=3"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    want = cross_entropy(model(inputs), targets)
    want_g = torch.autograd.grad(want, list(model.parameters()))
    loss_fn = head_loss(Decisions.of(cfg).loss_chunks, [model])
    assert not loss_fn.logits
    hidden = loss_fn.model_output(model, inputs)
    assert hidden.shape == (2, 16, int(cfg.model.dim))
    got = loss_fn(hidden, targets)
    got_g = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(got_g, want_g, strict=True):
        assert _rel(a, b) <= 1e-6


def test_model_without_the_switch_is_refused() -> None:
    """A module that only returns logits cannot take the chunked loss: one-line ConfigError, no fallback."""
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.train.loss import head_loss

    cfg = compose(["model=tiny", "training.loss_chunks=4"]).cfg
    with pytest.raises(ConfigError, match="training.loss_chunks=4: .* set training.loss_chunks=1"):
        head_loss(Decisions.of(cfg).loss_chunks, [torch.nn.Linear(4, 8)])


@pytest.mark.parametrize("tokens", [128, 1024])  # few tokens per chunk: the weight gradient's sum; many: the logits
def test_planner_chunk_term_matches_the_measured_peak(tokens: int) -> None:
    """dtlaunch.plan.loss_terms.loss_backward_bytes against the tracked peak of one chunked loss's forward
    and backward (fp32, 8 chunks, 32k vocabulary, gradients taken in forward), above the hidden states,
    the weight and the targets."""
    from types import SimpleNamespace

    from dtlaunch.plan.loss_terms import loss_backward_bytes
    from dtlaunch.train.observe.memtrack import StorageCounter

    h, v = 64, 32000
    hidden = torch.randn(1, tokens, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (1, tokens))
    with StorageCounter() as counter:
        counter.add_existing([hidden, weight, targets])
        base = counter.live
        chunked_cross_entropy(hidden, weight, targets, 8).backward()
    c = SimpleNamespace(
        last_stage=True, first_stage=False, decisions=SimpleNamespace(loss_chunks=8), cfg=SimpleNamespace(objective=SimpleNamespace(name="sft")), tokens=tokens, compute_bytes=4, tp=1, pp=1, sequence_parallel=False,
        block_dims=SimpleNamespace(h=h, vocab=v), fsdp=False, zero_stage=0, autocast=False, peft=None,
    )  # fmt: skip
    # The hidden states' gradient, made in forward: in a model it takes the place of the final norm's
    # output (which the loss no longer saves); here the hidden states are an input, counted in `base`.
    grad_hidden = 4 * tokens * h
    planned, measured = loss_backward_bytes(c) + grad_hidden, counter.peak - base
    assert abs(planned - measured) <= 0.01 * measured, (planned, measured)


def test_hf_auto_hidden_states_through_the_chunked_loss(tiny_hf_dirs) -> None:
    """model.arch=hf_auto (transformers' Qwen3): its decoder's hidden states through the chunked loss equal
    cross_entropy on transformers' own logits, loss and gradients."""
    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.loss import cross_entropy, head_loss
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    args = ["model.arch=hf_auto", f"model.init_from=hf:{tiny_hf_dirs['qwen3']}", "training.seq_len=16"]
    cfg = compose([*args, "training.loss_chunks=4"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, 17), generator=torch.Generator().manual_seed(5))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = [p for p in model.parameters() if p.requires_grad]
    want = cross_entropy(model(inputs), targets)
    want_g = torch.autograd.grad(want, params)
    loss_fn = head_loss(Decisions.of(cfg).loss_chunks, [model])
    assert not loss_fn.logits
    got = loss_fn(loss_fn.model_output(model, inputs), targets)
    got_g = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert max(_rel(a, b) for a, b in zip(got_g, want_g, strict=True)) <= 1e-5


def test_fused_gradients_equal_the_recomputed_chunks() -> None:
    """Gradients taken in forward (dtlaunch.train.loss.LinearCrossEntropy) against each chunk recomputed in
    backward under checkpointing (the pipeline's path), fp32."""
    hidden, weight, targets = _inputs(2)
    got = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 4, fused=True), (hidden, weight))
    want = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 4, fused=False), (hidden, weight))
    assert max(_rel(a, b) for a, b in zip(got, want, strict=True)) <= 1e-6


def test_fused_bf16_matches_autograd_and_its_plan() -> None:
    """bf16 weight and hidden states (FSDP's mixed precision): the loss and gradients of autograd through
    bf16 logits, and the planned peak (one chunk's fp32 logits + its bf16 cast, the bf16 weight gradient)."""
    from types import SimpleNamespace

    from dtlaunch.plan.loss_terms import loss_backward_bytes
    from dtlaunch.train.observe.memtrack import StorageCounter

    h, v, tokens = 64, 32000, 512
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, tokens, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (1, tokens), generator=g)
    want = _reference(hidden, weight, targets, "mean")
    want_g = torch.autograd.grad(want, (hidden, weight))
    with StorageCounter() as counter:
        counter.add_existing([hidden, weight, targets])
        base = counter.live
        got = chunked_cross_entropy(hidden, weight, targets, 8)
        got_g = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)
    assert max(_rel(a.float(), b.float()) for a, b in zip(got_g, want_g, strict=True)) <= 1e-2
    c = SimpleNamespace(
        last_stage=True, first_stage=False, decisions=SimpleNamespace(loss_chunks=8), cfg=SimpleNamespace(objective=SimpleNamespace(name="sft")), tokens=tokens, compute_bytes=2, tp=1, pp=1, sequence_parallel=False,
        block_dims=SimpleNamespace(h=h, vocab=v), fsdp=True, zero_stage=2, autocast=False, peft=None, head_unit=False,
    )  # fmt: skip
    planned = loss_backward_bytes(c) + 2 * tokens * h  # + the hidden states' gradient (see above)
    measured = counter.peak - base
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)
