"""Qwen3-Next's Gated DeltaNet (dtlaunch.models.qwen3_next.gated_deltanet) against transformers'
Qwen3NextGatedDeltaNet on a tiny random layer (2 key heads, 4 value heads: grouped q/k): outputs within
1e-5 and gradients within 1e-4 in fp32, across chunk boundaries; decoding with RecurrentState (a prefill,
single-token steps, a several-token chunk) equal to the full forward; a left-padded prompt equal to the
same prompt alone; transformers' own cached decoding agrees; packed documents (`Documents`) each equal to
transformers' layer on the document alone; dense masks refused without a cache; bf16 runs; the chunked and
recurrent rules agree, with state resets too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtlaunch.models.qwen3_next.gated_deltanet import (
    MASK_REFUSED,
    GatedDeltaNet,
    RecurrentState,
    chunk_gated_delta_rule,
    initial_value,
    recurrent_gated_delta_rule,
    state_bytes,
)

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

DIM = 32
OURS = SimpleNamespace(
    dim=DIM,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    norm_eps=1e-6,
)
# Nothing to compare: no RoPE in this layer.
COS = SIN = torch.empty(0)


def hf_config():
    return transformers.Qwen3NextConfig(
        hidden_size=DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        intermediate_size=64,
        vocab_size=64,
    )


@pytest.fixture(scope="module")
def pair():
    """transformers' layer with random weights (gain, decay and step bias too) and ours with its state_dict."""
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(hf_config(), 0).float()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p))
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # unit-variance activations (outputs of order 1, so 1e-5 is a fp32-sized tolerance)
                p.copy_(torch.randn_like(p) * p[0].numel() ** -0.5)
    ours = GatedDeltaNet(OURS)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _x(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, s, DIM, generator=torch.Generator().manual_seed(seed))


def test_names_and_shapes_are_transformers():
    theirs = Qwen3NextGatedDeltaNet(hf_config(), 0)
    ours = GatedDeltaNet(OURS)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.parametrize("s", [1, 5, 64, 130])
def test_forward_matches_transformers(pair, s):
    theirs, ours = pair
    x = _x(2, s)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, COS, SIN), theirs(x), rtol=0, atol=1e-5)


def test_gradients_match_transformers(pair):
    theirs, ours = pair
    x = _x(2, 70)
    grads = []
    for layer in (theirs, ours):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = layer(xi) if layer is theirs else layer(xi, COS, SIN)
        # A random projection of the output, so every output element's gradient differs.
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        grads.append({"input": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-4, msg=name)


def test_chunked_and_recurrent_rules_agree():
    g = torch.Generator().manual_seed(3)
    b, s, n_k, n_v, dk, dv = 2, 150, 2, 4, 8, 6
    q, k = torch.randn(b, s, n_k, dk, generator=g), torch.randn(b, s, n_k, dk, generator=g)
    v = torch.randn(b, s, n_v, dv, generator=g)
    decay = -torch.rand(b, s, n_v, generator=g) * 2
    beta = torch.rand(b, s, n_v, generator=g)
    state = torch.randn(b, n_v, dk, dv, generator=g)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(state_c, state_r, rtol=0, atol=1e-5)


def test_decoding_matches_full_forward(pair):
    _, ours = pair
    x = _x(2, 15, seed=4)
    with torch.no_grad():
        full = ours(x, COS, SIN)
        cache = RecurrentState()
        parts = [ours(x[:, :7], COS, SIN, cache=cache)]
        assert cache.length == 7 and cache.conv.shape == (2, ours.conv_dim, 3)
        assert cache.recurrent.shape == (2, 4, 8, 8) and cache.recurrent.dtype == torch.float32
        for t in range(7, 12):  # single-token steps
            parts.append(ours(x[:, t : t + 1], COS, SIN, cache=cache))
        parts.append(ours(x[:, 12:15], COS, SIN, cache=cache))  # a 3-token chunk
        assert cache.length == 15
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_decoding_matches_transformers_cache(pair):
    """transformers' own cached path (a prefill, then its recurrent steps) gives the same outputs and state."""
    theirs, ours = pair
    x = _x(2, 10, seed=9)
    hf_cache = transformers.DynamicCache(config=hf_config())
    cache = RecurrentState()
    with torch.no_grad():
        expected = [theirs(x[:, :6], cache=hf_cache)] + [theirs(x[:, t : t + 1], cache=hf_cache) for t in range(6, 10)]
        got = [ours(x[:, :6], COS, SIN, cache=cache)] + [
            ours(x[:, t : t + 1], COS, SIN, cache=cache) for t in range(6, 10)
        ]
    torch.testing.assert_close(torch.cat(got, dim=1), torch.cat(expected, dim=1), rtol=0, atol=1e-5)
    torch.testing.assert_close(cache.recurrent, hf_cache.get_recurrent_state(0, state_idx=0), rtol=0, atol=1e-5)


def test_decoding_from_a_short_prefill(pair):
    """A prefill shorter than the convolution's window (K-1 = 3), then steps."""
    _, ours = pair
    x = _x(1, 6, seed=5)
    with torch.no_grad():
        full = ours(x, COS, SIN)
        cache = RecurrentState()
        parts = [ours(x[:, :2], COS, SIN, cache=cache)]
        parts += [ours(x[:, t : t + 1], COS, SIN, cache=cache) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_left_padding_is_invisible(pair):
    _, ours = pair
    pad = 3
    long, short = _x(1, 9, seed=6), _x(1, 6, seed=7)
    # The short prompt left-padded with junk rows (the key mask must silence them, not their values).
    padded = torch.cat((torch.cat((torch.randn(1, pad, DIM) * 5, short), dim=1), long))
    key_mask = torch.ones(2, 9 + 2, dtype=torch.bool)
    key_mask[0, :pad] = False
    steps = _x(2, 2, seed=8)
    with torch.no_grad():
        cache = RecurrentState()
        cache.key_mask = key_mask
        # A mask argument is ignored while decoding.
        out = ours(padded, COS, SIN, mask=torch.ones(2, 1, 9, 9, dtype=torch.bool), cache=cache)
        out = torch.cat([out] + [ours(steps[:, t : t + 1], COS, SIN, cache=cache) for t in range(2)], dim=1)
        alone = ours(torch.cat((short, steps[:1]), dim=1), COS, SIN)
        together = ours(torch.cat((long, steps[1:]), dim=1), COS, SIN)
    torch.testing.assert_close(out[0, pad:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], together[0], rtol=0, atol=1e-5)


def test_dense_masks_refused_without_a_cache(pair):
    _, ours = pair
    x = _x(1, 4)
    with pytest.raises(ValueError) as info:
        ours(x, COS, SIN, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    assert str(info.value) == MASK_REFUSED


# Two packed rows: row 0's first document crosses the 64-token chunk, its second starts mid-chunk and its
# third 2 tokens after (fewer than the convolution's 3 of context); row 1's first fills a whole chunk.
PACKED = ((70, 2, 48), (64, 5, 51))


def _each_alone(layer, x, lengths, **kw):
    """The output of each document of each row run alone, back in place."""
    rows = []
    for row, ns in enumerate(lengths):
        starts = [sum(ns[:i]) for i in range(len(ns))]
        rows.append(
            torch.cat([layer(x[row : row + 1, a : a + n], **kw) for a, n in zip(starts, ns, strict=True)], dim=1)
        )
    return torch.cat(rows)


def test_packed_documents_each_run_alone(pair, monkeypatch):
    """With `Documents`, each document's output is transformers' layer on that document alone (convolution
    and state from zero at its start); without them the later documents read the earlier ones (so the
    comparison can fail), and so they do without either half of the separation: no state reset, or no
    zeros for the convolution between documents."""
    import dtlaunch.models.qwen3_next.gated_deltanet as gdn
    from dtlaunch.models.dense.documents import Documents

    theirs, ours = pair
    x = _x(2, 120, seed=9)
    with torch.no_grad():
        packed = ours(x, COS, SIN, Documents(PACKED))
        torch.testing.assert_close(packed, _each_alone(theirs, x, PACKED), rtol=0, atol=1e-5)
        torch.testing.assert_close(packed, _each_alone(ours, x, PACKED, cos=COS, sin=SIN), rtol=0, atol=1e-5)
        plain = ours(x, COS, SIN)
    torch.testing.assert_close(plain[0, :70], packed[0, :70], rtol=0, atol=1e-5)  # the first is alone anyway
    for row, start, end in ((0, 70, 72), (0, 72, 120), (1, 64, 69), (1, 69, 120)):
        assert (plain[row, start:end] - packed[row, start:end]).abs().max() > 1e-3, (row, start)

    rule, layout = gdn.chunk_gated_delta_rule, gdn._document_layout
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(gdn, "chunk_gated_delta_rule", lambda *a, resets=None, **kw: rule(*a, **kw))
        no_reset = ours(x, COS, SIN, Documents(PACKED))
    assert (no_reset[0, 72:] - packed[0, 72:]).abs().max() > 1e-3, "the state reset"
    with torch.no_grad(), monkeypatch.context() as patch:
        # No free positions before a document: row 1's second starts right after its first (at 64).
        patch.setattr(gdn, "_document_layout", lambda lengths, chunk, gap: layout(lengths, chunk, 0))
        no_gap = ours(x, COS, SIN, Documents(PACKED))
    assert (no_gap[1, 64:69] - packed[1, 64:69]).abs().max() > 1e-3, "the convolution's zeros"


def test_state_resets_in_the_chunked_rule():
    """`resets` zeroes the state entering a chunk: equal to the recurrent rule restarted there."""
    g = torch.Generator().manual_seed(4)
    b, s, n_k, n_v, dk, dv = 2, 192, 2, 4, 8, 6
    q, k = torch.randn(b, s, n_k, dk, generator=g), torch.randn(b, s, n_k, dk, generator=g)
    v = torch.randn(b, s, n_v, dv, generator=g)
    decay, beta = -torch.rand(b, s, n_v, generator=g) * 0.1, torch.rand(b, s, n_v, generator=g)
    resets = torch.tensor([[True, False, True], [True, True, False]])
    out, _ = chunk_gated_delta_rule(q, k, v, decay, beta, resets=resets)
    for row, cuts in ((0, (0, 128, 192)), (1, (0, 64, 192))):
        for a, e in zip(cuts[:-1], cuts[1:], strict=True):
            want, _ = recurrent_gated_delta_rule(*(t[row : row + 1, a:e] for t in (q, k, v, decay, beta)))
            torch.testing.assert_close(out[row : row + 1, a:e], want, rtol=0, atol=1e-5)
    assert (chunk_gated_delta_rule(q, k, v, decay, beta)[0] - out).abs().max() > 1e-3


def test_bf16_runs(pair):
    _, ours = pair
    layer = GatedDeltaNet(OURS).to(torch.bfloat16)
    layer.load_state_dict(ours.state_dict())
    x = _x(2, 70).to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x, COS, SIN)
        cache = RecurrentState()
        layer(x[:, :5], COS, SIN, cache=cache)
        step = layer(x[:, 5:6], COS, SIN, cache=cache)
    assert out.dtype == step.dtype == torch.bfloat16
    assert cache.conv.dtype == torch.bfloat16 and cache.recurrent.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(step.float(), out[:, 5:6].float(), rtol=0.05, atol=0.05)


def test_builds_on_meta():
    with torch.device("meta"):
        layer = GatedDeltaNet(OURS)
    assert all(p.is_meta for p in layer.parameters())


def test_initial_values():
    g = torch.Generator().manual_seed(0)
    a_log = initial_value("layers.0.attention.A_log", (4096,), g)
    assert a_log.dtype == torch.float32 and a_log.shape == (4096,)
    assert 0.01 <= a_log.exp().min() and a_log.exp().max() <= 16 and a_log.exp().mean() > 7
    assert torch.equal(initial_value("layers.0.attention.dt_bias", (4,), g), torch.ones(4))
    assert torch.equal(initial_value("layers.0.attention.norm.weight", (8,), g), torch.ones(8))
    conv = initial_value("layers.0.attention.conv1d.weight", (64, 1, 4), g)
    assert conv.shape == (64, 1, 4) and 0.01 < conv.std() < 0.03
    for other in ("layers.0.attention.in_proj_qkvz.weight", "layers.0.attention.out_proj.weight", "norm.weight"):
        assert initial_value(other, (4, 4), g) is None


def test_state_bytes_counts_the_cache(pair):
    _, ours = pair
    cache = RecurrentState()
    with torch.no_grad():
        ours(_x(3, 5), COS, SIN, cache=cache)
    counted = cache.conv.numel() * 4 + cache.recurrent.numel() * 4
    assert state_bytes(OURS, 3, 4) == counted
    assert state_bytes(OURS, 3, 2) == cache.conv.numel() * 2 + cache.recurrent.numel() * 4


class _ThreadGroup:
    """One rank's view of an in-process 'CP group' of threads: all_to_all_single's rows swapped through shared
    slots (tests only: the exchange's code runs as it is, its collective replaced)."""

    def __init__(self, slots: list, barrier, rank: int) -> None:
        self.slots, self.barrier, self.rank = slots, barrier, rank

    def all_to_all(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        self.slots[self.rank] = rows
        self.barrier.wait()
        out.copy_(torch.stack([self.slots[j][self.rank] for j in range(len(self.slots))]))
        self.barrier.wait()


def test_ulysses_exchange_runs_the_whole_sequence(pair, monkeypatch):
    """Context parallel as Ulysses (cp=2, two threads in the place of two ranks, each holding its load-balanced
    chunks; the exchange's code with all_to_all_single swapped through shared slots): every rank's output is
    the one-process output at its tokens, and the ranks' parameter gradients add up to the one-process
    gradients (input gradients: each rank's tokens'). 96 tokens: the exchanged
    sequence crosses the rule's 64-token chunk boundary."""
    import copy
    import threading

    import torch.distributed as dist

    from dtlaunch.train.parallel import ulysses
    from dtlaunch.train.parallel.context_parallel import local_positions

    _, ours = pair
    cp, s = 2, 96
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, rows, group: group.all_to_all(out, rows))
    x = _x(2, s, seed=3)
    weights = torch.randn(2, s, DIM, generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(ours)
    xr = x.clone().requires_grad_(True)
    want = ref(xr, COS, SIN)
    (want * weights).sum().backward()

    slots, barrier = [None] * cp, threading.Barrier(cp, timeout=60)
    results: dict = {}

    def rank(r: int) -> None:
        layer = copy.deepcopy(ours)
        layer.sequence_exchange = ulysses.UlyssesHeads(ulysses.UlyssesExchange(_ThreadGroup(slots, barrier, r), cp), r)
        keep = torch.from_numpy(local_positions(s, r, cp))
        xi = x[:, keep].clone().requires_grad_(True)
        out = layer(xi, COS, SIN)
        (out * weights[:, keep]).sum().backward()
        results[r] = (keep, out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(cp))
    for keep, out, grad_x, _ in results.values():
        torch.testing.assert_close(out, want.detach()[:, keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(grad_x, xr.grad[:, keep], rtol=0, atol=1e-5)
    for name, p in ref.named_parameters():
        summed = sum(grads[name] for *_, grads in results.values())
        # fp32 sums in another order: within 1e-5 of the largest entry (the projections' reach ~600 here)
        diff, scale = (summed - p.grad).abs().max().item(), p.grad.abs().max().item()
        assert scale > 0 and diff <= 1e-5 * scale, (name, diff, scale)
