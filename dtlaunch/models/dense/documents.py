"""Attention over packed documents (data.document_mask=true) without an [S x S] mask.

A dense boolean mask "causal and same document" costs B * S^2 bytes, kept for backward (16 GiB per
sequence at S = 131,072, twice that while it is built), and takes SDPA off its causal fast path. Here
each document of each row runs SDPA's own causal kernel on its slice of q, k and v (the varlen approach
of FlashAttention's `cu_seqlens`, with torch's stock kernels), so attention holds what plain causal
attention holds (q, k, v and its output, in the buffer the output projection reads); backward recomputes
each document's attention (see `_DocumentAttention`). FlexAttention would do this in one kernel, but it
has no backward on CPU; torch's varlen_attn is CUDA flash only.

The lengths are read on the host once per forward (`Documents.of`), outside the compiled blocks; under
training.compile the attention runs eagerly (dtlaunch.train.parallel.parallelize.apply_compile), so a
new batch's lengths are not a recompile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Documents:
    """The document lengths of each row of a (B, S) batch, in order (each row's sum is S)."""

    lengths: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, doc_ids: torch.Tensor) -> Documents:
        """From per-token document ids (B, S), non-decreasing along each row (dtlaunch.train.data)."""
        rows = []
        for row in doc_ids.cpu():
            _, counts = torch.unique_consecutive(row, return_counts=True)
            rows.append(tuple(int(n) for n in counts.tolist()))
        return cls(tuple(rows))


def dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) boolean, True where a query may attend (causal and same document): for a sliding window
    inside each document, which needs a mask anyway."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
    """Causal attention inside each document: q (B, heads, S, head_dim), k and v (B, kv heads, S, head_dim)
    -> (B, heads, S, head_dim)."""
    return _DocumentAttention.apply(q, k, v, docs)


class _DocumentAttention(torch.autograd.Function):
    """Forward keeps q, k, v and the output, as SDPA does (less its logsumexp); backward recomputes one
    document's attention at a time and takes its gradients. Letting autograd record each document's SDPA
    instead would keep every document's output twice over: once saved by its SDPA node, once in the
    buffer the output projection reads (a plain SDPA call's saved output *is* that buffer). The price is
    one more attention forward per step, document by document."""

    @staticmethod
    def forward(ctx, q, k, v, docs):  # noqa: ANN001, ANN205 -- autograd.Function's protocol
        ctx.docs = docs
        ctx.save_for_backward(q, k, v)
        b, h, s, d = q.shape
        # Laid out as the output projection reads it: the caller's transpose-and-reshape copies nothing.
        out = q.new_empty(b, s, h, d)
        for row, start, end in _spans(docs):
            out[row, start:end] = _causal(q, k, v, row, start, end)[0].transpose(0, 1)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for row, start, end in _spans(ctx.docs):
            parts = [t[row : row + 1, :, start:end].detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                out = _causal(*parts, 0, 0, end - start)
            grads = torch.autograd.grad(out, parts, grad[row : row + 1, :, start:end])
            for whole, part in zip((dq, dk, dv), grads, strict=True):
                whole[row : row + 1, :, start:end] = part
        return dq, dk, dv, None


def _spans(docs: Documents):  # noqa: ANN202 -- an iterator of (row, start, end)
    for row, lengths in enumerate(docs.lengths):
        start = 0
        for n in lengths:
            yield row, start, start + n
            start += n


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: int, start: int, end: int) -> torch.Tensor:
    """SDPA's causal kernel on one document: positions [start, end) of batch row `row`."""
    return F.scaled_dot_product_attention(
        q[row : row + 1, :, start:end],
        k[row : row + 1, :, start:end],
        v[row : row + 1, :, start:end],
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )
