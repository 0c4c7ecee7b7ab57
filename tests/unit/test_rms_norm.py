"""dtlaunch's RMSNorm against the plain-op version autograd differentiates (Meta's and Hugging Face's
formula): the same outputs and gradients bit for bit, and less kept for backward."""

import pytest
import torch

from dtlaunch.models.dense.norm import RMSNorm


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def saved_bytes(fn, *args):
    """Bytes of the distinct storages autograd keeps for backward (saved-tensor hooks)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, seen


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 5, 3, 16)])
@pytest.mark.parametrize("train_weight", [True, False])
def test_gradients_equal_plain_autograd_bit_for_bit(x_dtype, w_dtype, shape, train_weight):
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(shape, generator=g) * 3).to(x_dtype)
    w0 = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    results = []
    for use_module in (False, True):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(train_weight)
        if use_module:
            norm = RMSNorm(shape[-1], 1e-5)
            norm.weight = w = torch.nn.Parameter(w.detach(), requires_grad=train_weight)
            y = norm(x)
        else:
            y = plain_rms_norm(x, w, 1e-5)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        y.backward(gy)
        results.append((y, x.grad, w.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert y0.dtype == y1.dtype and torch.equal(y0, y1)
    assert gx0.dtype == gx1.dtype and torch.equal(gx0, gx1)
    if train_weight:
        assert gw0.dtype == gw1.dtype and torch.equal(gw0, gw1)
    else:
        assert gw1 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_only_its_input_and_one_rsqrt_per_row(dtype):
    b, s, h = 2, 16, 64
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    norm = RMSNorm(h, 1e-6).to(dtype)
    _, kept = saved_bytes(norm, x)
    params = {norm.weight.untyped_storage().data_ptr()}
    kept = {p: n for p, n in kept.items() if p not in params}
    e = x.element_size()
    assert sorted(kept.values()) == sorted([b * s * h * e, b * s * 4])
    # The plain version keeps an fp32 copy (bf16) or the normalised value (both dtypes) on top.
    _, plain = saved_bytes(plain_rms_norm, x, norm.weight, 1e-6)
    plain = {p: n for p, n in plain.items() if p not in params}
    assert sum(plain.values()) >= sum(kept.values()) + b * s * h * e


def gemma_rms_norm(x, weight, eps):
    """transformers' Gemma3RMSNorm: fp32 throughout, gain (1 + weight), one rounding at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_offset_norm_matches_gemma_and_keeps_the_same_tensors(x_dtype, w_dtype):
    """Gemma's (1 + w) norm (offset 1.0): transformers' output bit for bit, its gradients within rounding,
    and the same saved tensors as the plain norm (input, rsqrt, gain): the planner's terms hold."""
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(2, 7, 48, generator=g) * 3).to(x_dtype)
    w0 = (0.1 * torch.randn(48, generator=g)).to(w_dtype)
    results = []
    for use_module in (False, True):
        x = x0.clone().requires_grad_(True)
        w = torch.nn.Parameter(w0.clone())
        if use_module:
            norm = RMSNorm(48, 1e-6, offset=1.0)
            assert torch.equal(norm.weight, torch.zeros(48))
            norm.weight = w
            y, seen = saved_bytes(norm, x)
            assert sum(seen.values()) == x.numel() * x.element_size() + 2 * 7 * 4 + 48 * w.element_size()
        else:
            y = gemma_rms_norm(x, w, 1e-6)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
        results.append((y, x.grad, w.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert y0.dtype == y1.dtype and torch.equal(y0, y1)
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    assert gx1.dtype == x_dtype and torch.allclose(gx0.float(), gx1.float(), rtol=tol, atol=tol)
    assert gw1.dtype == w_dtype and torch.allclose(gw0.float(), gw1.float(), rtol=tol, atol=tol * 10)
