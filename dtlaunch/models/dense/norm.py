"""RMSNorm that keeps its input and one rsqrt per row for backward, nothing else.

Written as plain ops, autograd would keep the input's fp32 copy (`x.float()`, 4 bytes per element even for
a bf16 stream) and the normalised value before the gain for the gain's gradient. At long context those
dominate a block's recompute: 8 bytes per element of two norms per block, 18 GiB at 600k tokens on an
8B model. This Function saves the input itself (usually alive anyway as the block input) and recomputes
the normalised value in backward (one elementwise pass). torch.compile's partitioner already made that
choice for compiled blocks; eager now matches it.

Forward runs the same ops as Meta's and Hugging Face's RMSNorm (normalise in fp32, cast to the input dtype,
then multiply by the gain). Backward replays, op for op, the formulas autograd uses for those ops
(torch's derivatives.yaml: mul, rsqrt, mean, pow, the dtype casts), so gradients are bit-identical to
the plain-op version (tests/unit/test_rms_norm.py).

Gemma's RMSNorm (`offset` 1.0) multiplies by (1 + gain), its gains stored zero-centred, and rounds to the
input dtype only after the gain (transformers' Gemma3RMSNorm); its Function saves the same three tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * _rstd(xf, eps)).type_as(x) * weight


def _offset_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    return (xf * _rstd(xf, eps) * (weight.float() + offset)).type_as(x)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        # Few input-sized temporaries at once (this runs inside a block's backward, at its memory peak):
        # each product is formed when needed and updated in place; in-place and regrouped products by 2 give
        # the same roundings as the plain version (multiplying by 2 is exact).
        x, rstd, weight = ctx.saved_tensors
        xf = x.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            # y = normed.type_as(x) * weight: mul's gradient in the gain's dtype, summed over the broadcast.
            grad_w = (grad * (xf * rstd).type_as(x)).to(weight.dtype).sum_to_size(weight.shape)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        # Through the mul (to the input dtype) and the cast back to fp32, as autograd rounds them.
        grad_n = (grad * weight).to(x.dtype).float()
        # normed = xf * rstd: rstd's gradient (then rsqrt's, mean's and pow's), and xf's direct one.
        grad_rstd = (grad_n * xf).sum(-1, keepdim=True)
        grad_xf = grad_n.mul_(rstd)
        grad_var = -0.5 * grad_rstd * rstd.pow(3)
        # mean's gradient, expand / n, then pow's, times 2·xf: per row (grad_var / n)·2, then times xf.
        grad_xf.add_(xf * (grad_var / xf.shape[-1] * 2.0))
        return grad_xf.to(x.dtype), grad_w, None


class _OffsetRMSNorm(torch.autograd.Function):
    """y = (x·rstd·(offset + gain)).type_as(x), computed in fp32 (Gemma's order: one rounding, at the end)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        xf = x.float()
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.offset = offset
        return (xf * rstd * (weight.float() + offset)).type_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None, None]:
        x, rstd, weight = ctx.saved_tensors
        xf, gf = x.float(), grad.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (gf * (xf * rstd)).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None, None
        grad_n = gf.mul_(weight.float() + ctx.offset) if gf is not grad else gf * (weight.float() + ctx.offset)
        grad_rstd = (grad_n * xf).sum(-1, keepdim=True)
        grad_xf = grad_n.mul_(rstd)
        grad_var = -0.5 * grad_rstd * rstd.pow(3)
        grad_xf.add_(xf * (grad_var / xf.shape[-1] * 2.0))
        return grad_xf.to(x.dtype), grad_w, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        # Gemma: the gain applied is offset + weight (offset 1.0, weights initialised to zero).
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        # Set on the residual stream's norms when it is kept in a low precision under autocast
        # (Decoder.keep_residual_in): the fp32 gain would otherwise promote the output back to fp32.
        self.out_dtype: Optional[torch.dtype] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # decoding, log-probs: the Functions' forward ops, without their call
            y = _offset_norm(x, self.weight, self.eps, self.offset) if self.offset else _norm(x, self.weight, self.eps)
        elif self.offset:
            y = _OffsetRMSNorm.apply(x, self.weight, self.eps, self.offset)
        else:
            y = _RMSNorm.apply(x, self.weight, self.eps)
        return y if self.out_dtype is None else y.to(self.out_dtype)
