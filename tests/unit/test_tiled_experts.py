"""Tiled routed experts (dtlaunch/train/features/tiled_mlp.py `tiled_experts_forward`) against the untiled MoE layer,
one process, fp32: the layer's output, its input gradient and every parameter's gradient. Both expert
kernels (the loop, and torch's grouped GEMM where this torch has the CPU kernel), uneven expert loads with
one expert that gets no token, tiles that hold no row of most experts, and a rank with no row at all."""

import copy

import pytest
import torch

from dtlaunch.models.moe.experts import GroupedExperts, cpu_grouped_mm_dtypes, grouped_mm_supported
from dtlaunch.models.moe.layer import MoE
from dtlaunch.train.features.tiled_mlp import tiled_experts_forward

TOKENS, EXPERTS, TOP_K, UNUSED = 37, 6, 2, 4


class _Block(torch.nn.Module):
    """What apply_tiled_mlp walks: a model's `layers` holding the MoE layer."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": moe})


def _moe(dim: int, hidden: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dim, hidden, EXPERTS, TOP_K, num_shared=1, aux_loss_coef=0.01, expert_bias=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    # Expert UNUSED is never chosen (the bias only chooses, it never weights): zero rows in every tile.
    moe.router.expert_bias[UNUSED] = -1e4
    return moe


def _run(moe: torch.nn.Module, x: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


@pytest.mark.parametrize("kernel", ["looped", "grouped"])
@pytest.mark.parametrize("tiles", [3, 7, 200])
def test_tiled_experts_match_untiled(kernel: str, tiles: int) -> None:
    from dtlaunch.train.features.tiled_mlp import apply_tiled_mlp

    # fp32 rows of 8 (32 bytes) suit the grouped GEMM; a hidden width of 10 (40 bytes) does not.
    dim, hidden = (8, 12) if kernel == "grouped" else (8, 10)
    plain = _moe(dim, hidden)
    x = torch.randn(TOKENS, dim, generator=torch.Generator().manual_seed(1))
    w = plain.experts.w1
    if kernel == "grouped" and not grouped_mm_supported(x, w, torch.float32):
        pytest.skip(f"no CPU grouped GEMM for fp32 here ({sorted(map(str, cpu_grouped_mm_dtypes()))})")
    assert kernel == "grouped" or not grouped_mm_supported(x, w, torch.float32)
    tiled = copy.deepcopy(plain)
    assert apply_tiled_mlp(_Block(tiled), tiles) == 2  # the shared experts' FeedForward and the routed experts
    counts = torch.bincount(plain.router(x)[1].flatten(), minlength=EXPERTS)
    assert counts[UNUSED] == 0 and len(set(counts.tolist())) > 2  # uneven loads, one idle expert
    out, gx, grads = _run(plain, x)
    tout, tgx, tgrads = _run(tiled, x)
    # Within an ulp: a matmul's blocking (so its rounding) follows the number of rows it is given.
    torch.testing.assert_close(tout, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tgx, gx, rtol=1e-6, atol=1e-6)
    assert grads.keys() == tgrads.keys()
    for n, g in grads.items():
        assert tgrads[n] is not None, n
        torch.testing.assert_close(tgrads[n], g, rtol=1e-6, atol=1e-6, msg=n)
    assert not tgrads["experts.w1"][UNUSED].any()
    # Evaluation (no grad) runs the tiles too, with the same numbers.
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), plain(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counts", [[3, 0, 4, 0], [0, 0, 0, 0]])
def test_tiles_without_rows(counts: list[int]) -> None:
    """Tiles of one row each (most experts have no row in a tile), and an expert-parallel rank that
    received no row at all: the experts' gradients are zeros (not None), as untiled."""
    torch.manual_seed(0)
    experts = GroupedExperts(len(counts), 8, 10)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    n = torch.tensor(counts)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    plain = experts(x, n)
    plain.sum().backward()
    want = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    tiled = tiled_experts_forward(experts, 16, x.detach().requires_grad_(), n)
    torch.testing.assert_close(tiled, plain.detach(), rtol=1e-6, atol=1e-6)
    tiled.sum().backward()
    for p, g in zip(experts.parameters(), want, strict=True):
        # A weight's gradient sums over rows in another order tiled (one matmul per tile): an fp32 rounding
        # relative to the largest terms, which cancellation can leave beside a small entry (seen: 1.7e-6 on
        # an entry of 0.065 where the gradient reaches tens); zeros stay exactly zero.
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6 * max(1.0, g.abs().max().item()))


def test_recompute_replays_autocast() -> None:
    """Backward runs outside the autocast region: the recompute must compute in the forward's dtype, as
    a LoRA run's frozen bf16 experts (fed the fp32 residual stream) need, with the untiled gradients."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 10)  # 40-byte fp32 rows: the loop, whose matmuls need one dtype
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    experts.w2.requires_grad_(False)
    experts.w2.data = experts.w2.data.bfloat16()  # frozen, stored in the compute dtype
    n = torch.tensor([5, 0, 6])
    x = torch.randn(11, 8)
    grads = []
    for forward in (type(experts).forward, lambda *a: tiled_experts_forward(experts, 4, *a[1:])):
        inp = x.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(experts, inp, n)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append((inp.grad, experts.w1.grad, experts.w3.grad))
    for want, got in zip(*grads, strict=True):
        # bf16 matmuls over other row counts round otherwise: within bf16's precision of the norm
        assert got.dtype == want.dtype and (got - want).norm() <= 1e-2 * want.norm()
