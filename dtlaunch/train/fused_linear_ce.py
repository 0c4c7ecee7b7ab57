"""The output head and cross-entropy by token chunks, with their gradients computed in forward.

The loss is the last thing forward computes and the first thing backward differentiates, and nothing
else runs in between. So each chunk's gradients can be taken while its logits exist, in forward: softmax
minus the one-hot target is d(loss)/d(logits), which gives the hidden states' gradient (dlogits @ W) and
the head weight's (dlogits^T @ h, accumulated in place over the chunks). Backward then only scales the
two saved gradients by its incoming gradient. Against recomputing each chunk's logits in backward
(checkpointing) this saves one head matmul per token (2·h·V FLOPs) and the hidden states the recompute
would keep, and the weight's gradient never exists three times at once (autograd adds each chunk's
contribution out of place). The same idea as Liger-Kernel's fused linear cross-entropy, in plain torch.

Numerics follow `F.cross_entropy(F.linear(h, W).float(), t)`: logits in the matmul's dtype, softmax in
fp32, dlogits cast back to the matmul's dtype for the two gradient matmuls, as autograd does. Used where
the weight and hidden states are plain tensors and the loss's backward follows its forward directly
(dtlaunch.train.chunked_loss: not under tensor parallel, whose DTensor losses keep the recompute, nor a
pipeline, whose last stage can hold several micro-batches between the two).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dtlaunch.train.data import IGNORE_INDEX as IGNORE  # masked (chat) targets


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (T, h) hidden states projected by a (V, h) weight, over `chunks` token chunks.
    `dtype`: the matmuls' dtype (autocast's; None = the weight's)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunks: int,
        dtype: Optional[torch.dtype],
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # the casts below are the autocast ones
            w = weight.to(dtype) if dtype is not None else weight
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(w) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for h_c, t_c, gh_c in zip(
                hidden.tensor_split(chunks),
                targets.tensor_split(chunks),
                grad_h.tensor_split(chunks) if grad_h is not None else [None] * chunks,
                strict=True,
            ):
                if t_c.numel() == 0:
                    continue
                h_c = h_c.to(w.dtype)
                z = (h_c @ w.t()).float()
                keep = t_c != IGNORE
                pick = t_c.masked_fill(~keep, 0).unsqueeze(1)
                picked = z.gather(1, pick).squeeze(1)
                # log-sum-exp and softmax in z's own storage (torch.logsumexp would allocate a second one).
                top = z.amax(dim=-1, keepdim=True)
                z.sub_(top).exp_()
                norm = z.sum(dim=-1, keepdim=True)
                lse = (top + norm.log()).squeeze(1)
                total += torch.where(keep, lse - picked, 0.0).sum()
                if not (need_h or need_w):
                    del z
                    continue
                # d(loss)/d(logits) in place: softmax - one-hot on the rows that count, zero on the others.
                z.div_(norm)
                z.scatter_add_(1, pick, -torch.ones_like(z[:, :1]))
                z.mul_(keep.unsqueeze(1))
                dz = z.to(w.dtype)
                del z
                if gh_c is not None:
                    gh_c.copy_(dz @ w)
                if grad_w is not None:
                    grad_w.addmm_(dz.t(), h_c)
                del dz  # before the next chunk's logits exist
        # Kept on ctx, not save_for_backward: gradients, not activations (no saved-tensor hooks, no version
        # checks), dropped by backward.
        ctx.weight_dtype, ctx.grads = weight.dtype, (grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        (grad_h, grad_w), ctx.grads = ctx.grads, None
        # The saved gradients are this call's own: scaled in place, handed over once.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out.to(grad_w.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int
) -> torch.Tensor:
    """Summed cross-entropy of (T, h) hidden states and (T,) targets through the (V, h) head weight, in
    the matmul dtype the caller's autocast would use."""
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return LinearCrossEntropy.apply(hidden, weight, targets, chunks, dtype)
