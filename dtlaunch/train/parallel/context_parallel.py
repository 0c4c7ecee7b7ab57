"""Context parallel (CP): each sequence split over the CP ranks; attention as ring attention over them.

Load-balanced layout: a sequence of S tokens is cut into 2·cp chunks of S/(2·cp) tokens and CP rank r
holds chunks r and 2·cp−1−r, in that order (the "head-tail" layout torch's context_parallel also uses).
Under causal attention chunk j attends to j+1 chunks, so every rank's two chunks add up to 2·cp+1
chunk pairs: the work is even. The data loader cuts inputs, targets and loss masks this way
(`local_positions`) and hands the model the tokens' true positions for RoPE.

Attention: the model's attention module calls a pluggable function (`Attention.attention_fn`); `apply_cp`
swaps in a context-parallel one.
- CUDA (NCCL): torch's own ring attention (its SDPA ops dispatched on sequence-sharded DTensors).
- CPU (gloo), where torch's does not run: `RingAttention` below. K/V are exchanged with an all-gather
  over the CP group rather than cp−1 send/recv steps: under the head-tail layout every rank needs
  nearly every chunk anyway (rank 0's second chunk sees all but one), one collective per block replaces
  cp−1 dependent ones, and the result is deterministic and simple to get exactly right. The gathered
  K/V are transient: backward gathers them again instead of keeping them, so a block saves only its own
  q, k, v, output and log-sum-exp, as plain attention does.
  Each local query chunk c needs at most two kernel calls: chunks 0..c−1 fully visible (no mask) and
  its own chunk (causal); the two partial results are merged with their log-sum-exp. Backward runs the
  kernel's backward per block with the merged output and log-sum-exp (which gives each block's exact
  share of the gradient) and reduce-scatters dK/dV of the whole sequence back to the ranks that own them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlaunch.errors import ConfigError


def local_positions(seq_len: int, cp_rank: int, cp: int) -> np.ndarray:
    """Positions (in the whole sequence) of the tokens CP rank `cp_rank` holds, in its local order."""
    c = seq_len // (2 * cp)
    head, tail = cp_rank, 2 * cp - 1 - cp_rank
    return np.concatenate([np.arange(head * c, (head + 1) * c), np.arange(tail * c, (tail + 1) * c)])


# ----------------------------------------------------------------------------------------------------------
# The block kernel: attention of a query chunk against a key block, returning the log-sum-exp too.


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple:
    """(out, lse) for (B, H, Sq, D) inputs; lse (B, H, Sq) in fp32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> tuple:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted merge of partial attention results over disjoint key blocks."""
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    lses = torch.stack([lse for _, lse in parts])
    lse = torch.logsumexp(lses, dim=0)
    out = sum(torch.exp(part_lse - lse).unsqueeze(-1) * o.float() for o, part_lse in parts)
    return out.to(dtype), lse


# ----------------------------------------------------------------------------------------------------------
# Layout of the gathered K/V: rank r's local (B, H, 2c, D) tensor holds chunks r and 2cp-1-r (Ulysses'
# exchange, train/parallel/ulysses.py, orders its received chunks the same way).


def sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp, B, H, 2c, D) as gathered -> (B, H, S, D) in sequence order."""
    heads = [gathered[r].chunk(2, dim=2)[0] for r in range(cp)]
    tails = [gathered[r].chunk(2, dim=2)[1] for r in reversed(range(cp))]
    return torch.cat(heads + tails, dim=2)


def rank_rows(full: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, H, S, D) in sequence order -> (cp, B, H, 2c, D), rank r's chunks at index r (inverse of sequence_order)."""
    chunks = full.chunk(2 * cp, dim=2)
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=2) for r in range(cp)])


def _expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves `groups` consecutive query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


class _Exchange:
    """How a rank obtains every rank's K/V and returns their gradients: collectives over the CP group, or
    (for unit tests of the numerics) the full per-rank tensors handed in directly."""

    def __init__(self, group: Any, cp: int) -> None:
        self.group, self.cp = group, cp

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        # Concatenated on dim 0 (the shape gloo and NCCL both take), then one row per rank.
        out = t.new_empty((self.cp * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out.unflatten(0, (self.cp, -1))

    def reduce_scatter(self, per_rank: torch.Tensor) -> torch.Tensor:
        out = per_rank.new_empty(per_rank.shape[1:])
        dist.reduce_scatter_tensor(out, per_rank.flatten(0, 1).contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        return out


def _chunk_forward(q, k_glob, v_glob, chunk: int, c: int, scale: float, dtype) -> tuple:
    """Query chunk number `chunk` (global index) against the whole gathered K/V: earlier chunks fully,
    its own causally."""
    parts = []
    if chunk > 0:
        parts.append(_attend(q, k_glob[:, :, : chunk * c], v_glob[:, :, : chunk * c], False, scale))
    diag = slice(chunk * c, (chunk + 1) * c)
    parts.append(_attend(q, k_glob[:, :, diag], v_glob[:, :, diag], True, scale))
    return _merge(parts, dtype)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, exchange, cp_rank: int, scale: float):  # type: ignore[override]
        cp = exchange.cp
        groups = q.shape[1] // k.shape[1]
        k_glob = _expand_heads(sequence_order(exchange.gather(k), cp), groups)
        v_glob = _expand_heads(sequence_order(exchange.gather(v), cp), groups)
        c = q.shape[2] // 2
        outs, lses = [], []
        for half, chunk in enumerate((cp_rank, 2 * cp - 1 - cp_rank)):
            o, lse = _chunk_forward(q[:, :, half * c : (half + 1) * c], k_glob, v_glob, chunk, c, scale, q.dtype)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.exchange, ctx.cp_rank, ctx.scale, ctx.groups = exchange, cp_rank, scale, groups
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        exchange, cp_rank, scale, groups = ctx.exchange, ctx.cp_rank, ctx.scale, ctx.groups
        cp = exchange.cp
        k_glob = _expand_heads(sequence_order(exchange.gather(k), cp), groups)
        v_glob = _expand_heads(sequence_order(exchange.gather(v), cp), groups)
        dk_glob = torch.zeros(k_glob.shape, dtype=torch.float32, device=k.device)
        dv_glob = torch.zeros(v_glob.shape, dtype=torch.float32, device=v.device)
        dout = dout.contiguous()
        c = q.shape[2] // 2
        dqs = []
        for half, chunk in enumerate((cp_rank, 2 * cp - 1 - cp_rank)):
            rows = slice(half * c, (half + 1) * c)
            qc, oc, lc, gc = q[:, :, rows], out[:, :, rows], lse[:, :, rows].contiguous(), dout[:, :, rows]
            blocks = [(slice(chunk * c, (chunk + 1) * c), True)]
            if chunk > 0:
                blocks.append((slice(0, chunk * c), False))
            dq = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
            for cols, causal in blocks:
                g = _attend_backward(gc, qc, k_glob[:, :, cols], v_glob[:, :, cols], oc, lc, causal, scale)
                dq += g[0]
                dk_glob[:, :, cols] += g[1]
                dv_glob[:, :, cols] += g[2]
            dqs.append(dq)
        dk = exchange.reduce_scatter(rank_rows(_fold_heads(dk_glob, groups), cp))
        dv = exchange.reduce_scatter(rank_rows(_fold_heads(dv_glob, groups), cp))
        return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class RingAttention:
    """Causal attention of this rank's load-balanced chunks against the whole sequence (CPU / gloo).

    Called like the model's default attention function: (q, k, v, mask) with (B, H, S_local, D) tensors
    (fewer K/V heads for grouped-query attention); `mask` must be None (plain causal attention)."""

    def __init__(self, group: Any, cp_rank: int, cp: int) -> None:
        self.exchange = _Exchange(group, cp)
        self.cp_rank = cp_rank

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        refuse_mask(mask)
        if q.shape[2] % 2:
            raise ConfigError(f"context parallel: {q.shape[2]} local tokens cannot form two equal chunks")
        scale = q.shape[-1] ** -0.5
        return _RingAttentionFn.apply(q, k, v, self.exchange, self.cp_rank, scale)


class TorchRingAttention:
    """CUDA: torch's context-parallel SDPA (ring attention over NCCL with flash / efficient / cuDNN
    kernels). The local tensors become sequence-sharded DTensors on the CP mesh; with load balancing on,
    torch assumes the same head-tail chunk layout the data loader produces."""

    def __init__(self, cp_mesh: Any) -> None:
        try:
            from torch.distributed.tensor.experimental._attention import (
                _cp_options,
                _enable_context_parallel_dispatcher,
            )
        except ImportError as exc:  # an older torch without the dispatcher API
            raise ConfigError(
                f"strategy.cp on CUDA needs torch's context-parallel SDPA dispatcher, missing from torch "
                f"{torch.__version__}: upgrade torch (2.9 or newer) or use strategy.cp=1"
            ) from exc

        _cp_options.enable_load_balance = True
        _enable_context_parallel_dispatcher()
        self.mesh = cp_mesh

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        if mask is not None:
            raise ConfigError("context parallel runs plain causal attention only: set data.document_mask=false")
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_heads(k, groups), _expand_heads(v, groups)
        q, k, v = (DTensor.from_local(t.contiguous(), self.mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()


def attention_function(cp_mesh: Any) -> Callable:
    """The context-parallel attention function for this device: torch's on CUDA, ours elsewhere."""
    if cp_mesh.device_type == "cuda":
        return TorchRingAttention(cp_mesh)
    return RingAttention(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())


def apply_cp(model: nn.Module, cp_mesh: Any) -> None:
    """Swap every attention module's kernel for the context-parallel one (model code stays unaware)."""
    fn = attention_function(cp_mesh)
    swapped = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = fn
            swapped += 1
    if not swapped and getattr(model, "layers", None):
        raise ConfigError(
            "strategy.cp > 1 needs a model whose attention calls a pluggable attention_fn (the registry's "
            "dense decoder): use strategy.cp=1 for this model"
        )


def refuse_mask(mask: Optional[torch.Tensor]) -> None:
    """Both context-parallel styles attend plain causally over the whole sequence: no mask to split."""
    if mask is not None:
        raise ConfigError(
            "context parallel runs plain causal attention only: set data.document_mask=false and "
            "model.sliding_window=null (or strategy.cp=1)"
        )
