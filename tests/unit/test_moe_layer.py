"""The MoE layer's parts against plain per-token references: grouped experts (any contiguous split of
the experts gives the same rows), routing, the auxiliary loss's gradient and the token counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtlaunch.models.moe import experts
from dtlaunch.models.moe.experts import GroupedExperts, _grouped, _looped, cpu_grouped_mm_dtypes, grouped_mm_supported
from dtlaunch.models.moe.layer import MoE

DIM, HIDDEN, E = 16, 24, 4


def _experts(n: int = E, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    ex = GroupedExperts(n, DIM, HIDDEN)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    return ex


def _swiglu(x, w1, w2, w3):
    return F.silu(x @ w1.T) * (x @ w3.T) @ w2.T


def test_grouped_experts_match_a_per_row_reference_and_any_split() -> None:
    ex = _experts()
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), DIM)
    out = ex(x, counts)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    ref = torch.stack([_swiglu(x[i], ex.w1[e], ex.w2[e], ex.w3[e]) for i, e in enumerate(owner.tolist())])
    assert torch.allclose(out, ref, atol=1e-6)
    # Two ranks' halves of the experts (expert parallel): each computes its rows, concatenated = whole.
    halves = []
    for lo, hi in ((0, 2), (2, 4)):
        part = GroupedExperts(hi - lo, DIM, HIDDEN)
        part.load_state_dict({k: v[lo:hi] for k, v in ex.state_dict().items()})
        rows = slice(int(counts[:lo].sum()), int(counts[:hi].sum()))
        halves.append(part(x[rows], counts[lo:hi]))
    # Bit for bit with the loop; the grouped kernel's blocking follows the group sizes (within an ulp).
    torch.testing.assert_close(torch.cat(halves), out, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_kernel_equals_the_loop_forward_and_backward(dtype: torch.dtype) -> None:
    """Where this torch runs `_grouped_mm` on CPU the experts use it: same numbers as the loop (with an
    expert that gets no token), gradients included."""
    if dtype not in cpu_grouped_mm_dtypes():
        pytest.skip(f"torch._grouped_mm has no CPU kernel for {dtype} here")
    ex = _experts()
    counts = torch.tensor([4, 1, 0, 3])
    x0, g = torch.randn(8, DIM, dtype=dtype), torch.randn(8, DIM, dtype=dtype)
    results = []
    for kernel in (_grouped, _looped):
        x = x0.clone().requires_grad_()
        ws = [p.detach().to(dtype).requires_grad_() for p in (ex.w1, ex.w2, ex.w3)]
        out = kernel(x, *ws, counts)
        out.backward(g)
        results.append([out, x.grad, *(w.grad for w in ws)])
    for fast, loop in zip(*results, strict=True):
        assert torch.allclose(fast.float(), loop.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_experts_pick_the_grouped_kernel_by_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = _experts()
    x = torch.randn(8, DIM)
    assert grouped_mm_supported(x, ex.w1, torch.float32) == (torch.float32 in cpu_grouped_mm_dtypes())
    # Rows that are not a multiple of 16 bytes, or a torch without the CPU kernel: the loop.
    assert not grouped_mm_supported(torch.randn(8, 6), torch.randn(2, 8, 6), torch.float32)
    monkeypatch.setattr(experts, "cpu_grouped_mm_dtypes", lambda: frozenset())
    assert not grouped_mm_supported(x, ex.w1, torch.float32)
    counts = torch.tensor([4, 1, 0, 3])
    assert torch.equal(ex(x, counts), _looped(x, ex.w1, ex.w2, ex.w3, counts))


def test_grouped_kernel_under_autocast_computes_in_the_autocast_dtype() -> None:
    """torch has no autocast rule for `_grouped_mm`: the experts cast for it, as autocast does for the loop."""
    ex = _experts()
    counts = torch.tensor([4, 1, 0, 3])
    x = torch.randn(8, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ex(x, counts)
        loop = _looped(x, ex.w1, ex.w2, ex.w3, counts)
    assert out.dtype == loop.dtype == torch.bfloat16
    assert torch.allclose(out.float(), loop.float(), rtol=1e-2, atol=1e-3)


def _moe(score_func: str = "softmax", norm: bool = True, shared: int = 0, coef: float = 0.0) -> MoE:
    torch.manual_seed(1)
    moe = MoE(DIM, HIDDEN, E, 2, num_shared=shared, score_func=score_func, norm_topk=norm, aux_loss_coef=coef)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("score_func,norm,shared", [("softmax", True, 0), ("softmax", False, 1), ("sigmoid", True, 2)])
def test_moe_equals_per_token_top_k_sum(score_func: str, norm: bool, shared: int) -> None:
    moe = _moe(score_func, norm, shared)
    x = torch.randn(2, 5, DIM)
    out = moe(x)
    ex = moe.experts
    ref = torch.zeros(10, DIM)
    for t, row in enumerate(x.reshape(-1, DIM)):
        logits = row @ moe.router.gate.weight.T
        s = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        w, ids = s.topk(2)
        w = w / w.sum() if norm else w
        for wi, e in zip(w, ids.tolist(), strict=True):
            ref[t] += wi * _swiglu(row, ex.w1[e], ex.w2[e], ex.w3[e])
        if shared:
            ff = moe.shared_experts
            ref[t] += _swiglu(row, ff.w1.weight, ff.w2.weight, ff.w3.weight)
    assert torch.allclose(out.reshape(-1, DIM), ref, atol=1e-5)
    assert moe.tokens_per_expert.sum().item() == 20  # 10 tokens x top-2


def test_aux_loss_gradient_equals_an_explicit_loss_term() -> None:
    coef = 0.3
    with_aux, plain = _moe(coef=coef), _moe()
    x = torch.randn(12, DIM)
    with_aux(x).pow(2).sum().backward()
    out = plain(x)
    scores = (x @ plain.router.gate.weight.T).softmax(-1)
    chosen = F.one_hot(scores.topk(2).indices, E).sum(1).float()  # [T, E]
    aux = E * (chosen.mean(0) * scores.mean(0)).sum()
    (out.pow(2).sum() + coef * aux).backward()
    assert with_aux.aux_loss_stats[1].item() == 1 and abs(with_aux.aux_loss_stats[0].item() - aux.item()) < 1e-6
    for (name, a), b in zip(with_aux.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_expert_bias_changes_the_choice_not_the_weights() -> None:
    torch.manual_seed(1)
    moe = MoE(DIM, HIDDEN, E, 1, norm_topk=False, expert_bias=True)
    x = torch.randn(6, DIM)
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    w, ids, scores = moe.router(x)
    assert (ids == 3).all() and torch.equal(w[:, 0], scores[:, 3])


def test_checkpoint_replay_does_not_count_twice() -> None:
    moe = _moe(coef=0.1)
    x = torch.randn(7, DIM, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 14 and moe.aux_loss_stats[1].item() == 1
