"""Ulysses sequence parallel (DeepSpeed-Ulysses, as ALST runs it): context parallel's other attention
(`strategy.cp_style=ulysses`).

The sequence stays split over the CP ranks exactly as for ring attention: the loader's load-balanced
chunks (context_parallel.local_positions) and the tokens' true positions for RoPE. Around attention an
all-to-all trades the split: rank r sends its tokens of head group g to rank g and receives every rank's
tokens of head group r, so it holds the whole sequence for heads / cp heads; it puts the chunks in
sequence order, runs the plain causal kernel, and a second all-to-all returns each rank's own tokens of
every head. Backward is the same exchanges in reverse (an all-to-all is its own adjoint). Each exchange
moves one rank's share of q, k, v or the output, whatever the sequence length; ring attention gathers
the whole sequence's K/V instead. Any kernel works on the head shards, so Ulysses also serves
transformers' models (model.arch=hf_auto) through transformers' attention-function registry, where the
ring's own kernel cannot reach.

Heads: each rank's query heads (per tensor-parallel rank) must divide by cp (validated). K/V heads go as
they are when cp divides them; otherwise (grouped-query attention with fewer K/V heads than CP ranks)
each is repeated up to config.layout.ulysses_kv_heads, so every rank receives the K/V heads its query
heads read (query head i keeps reading K/V head i // group).

Recurrent blocks (the Gated DeltaNet of qwen3_next, qwen3_5, qwen3_5_moe) need the whole sequence in order
too, and their heads are independent as well: `apply_ulysses` hands each such module (a
`sequence_exchange` attribute) a `UlyssesHeads`, with which it trades this rank's tokens of every key head
for the whole sequence of key heads / cp (their value heads with them) around its convolution and rule.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlaunch.config.layout import ulysses_kv_heads
from dtlaunch.errors import ConfigError
from dtlaunch.train.parallel.context_parallel import rank_rows, refuse_mask, sequence_order

# The name under which transformers' models find the Ulysses attention (AttentionInterface). Not a mask
# implementation, so transformers builds no mask for it: attention is causal over the whole sequence.
HF_ATTENTION = "dtlaunch_ulysses"


class _AllToAll(torch.autograd.Function):
    """Row r of dim 0 goes to CP rank r; row r of the result came from rank r."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = torch.empty_like(rows, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, rows.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class UlyssesExchange:
    """The two re-layouts around attention, on (B, heads, tokens, head_dim) tensors."""

    def __init__(self, group: Any, cp: int) -> None:
        self.group, self.cp = group, cp

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of every head -> the whole sequence (in order) of this rank's heads / cp."""
        rows = t.unflatten(1, (self.cp, -1)).transpose(0, 1)  # row g: head group g, for rank g
        return sequence_order(_AllToAll.apply(rows, self.group), self.cp)

    def to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of to_heads: the whole sequence of this rank's heads -> its own tokens of every head."""
        got = _AllToAll.apply(rank_rows(t, self.cp), self.group)  # row r: this rank's tokens, head group r
        return got.transpose(0, 1).flatten(1, 2)

    def heads_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """q, k, v re-laid as head shards; K/V heads first repeated where cp does not divide them."""
        repeat = ulysses_kv_heads(k.shape[1], self.cp) // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v)


class UlyssesHeads:
    """The exchange a recurrent block calls itself (GatedDeltaNet.sequence_exchange): to_heads / to_tokens
    as UlyssesExchange's on (B, heads, tokens, D); `rank` is the head group this rank receives (its rank in
    the CP group) and `cp` the group's size."""

    def __init__(self, exchange: UlyssesExchange, rank: int) -> None:
        self.exchange, self.cp, self.rank = exchange, exchange.cp, rank

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        if t.shape[2] % 2:
            raise ConfigError(f"context parallel: {t.shape[2]} local tokens cannot form two equal chunks")
        if t.shape[1] % self.cp:
            raise ConfigError(
                f"strategy.cp_style=ulysses: {t.shape[1]} key heads per rank do not divide by strategy.cp={self.cp}"
            )
        return self.exchange.to_heads(t)

    def to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        return self.exchange.to_tokens(t)


def _check_local(q: torch.Tensor, cp: int) -> None:
    if q.shape[2] % 2:
        raise ConfigError(f"context parallel: {q.shape[2]} local tokens cannot form two equal chunks")
    if q.shape[1] % cp:  # validate checks the model's heads; this guards a module with other head counts
        raise ConfigError(
            f"strategy.cp_style=ulysses: {q.shape[1]} attention heads per rank do not divide by strategy.cp={cp}: "
            f"use a cp that divides them or strategy.cp_style=ring"
        )


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class UlyssesAttention:
    """The registry decoders' attention function (Attention.attention_fn): (q, k, v, mask) on
    (B, heads, local tokens, head_dim) -> the same layout; `mask` must be None (plain causal)."""

    def __init__(self, exchange: UlyssesExchange) -> None:
        self.exchange = exchange

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        refuse_mask(mask)
        _check_local(q, self.exchange.cp)
        return self.exchange.to_tokens(_causal(*self.exchange.heads_of(q, k, v)))


def hf_attention(exchange: UlyssesExchange) -> Callable:
    """Ulysses in transformers' attention-function signature: (module, query, key, value, attention_mask,
    dropout=, scaling=, ...) on (B, heads, local tokens, head_dim) -> ((B, local tokens, heads, head_dim), None)."""

    def forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kw):
        unsupported = {
            "an attention mask (padding or packed documents)": attention_mask is not None,
            "attention dropout": bool(dropout),
            "sliding-window attention": kw.get("sliding_window") is not None,
            "attention logit soft-capping": kw.get("softcap") is not None,
            "attention sinks": kw.get("s_aux") is not None,
        }
        for what, present in unsupported.items():
            if present:
                raise ConfigError(
                    f"strategy.cp_style=ulysses runs plain causal attention; {type(module).__name__} uses {what}: "
                    f"use strategy.cp=1 for this model"
                )
        _check_local(query, exchange.cp)
        out = exchange.to_tokens(_causal(*exchange.heads_of(query, key, value), scale=scaling))
        return out.transpose(1, 2), None

    return forward


def apply_ulysses(model: nn.Module, cp_mesh: Any) -> None:
    """Route every attention of `model` through Ulysses' exchange (model code stays unaware): the registry
    decoders' pluggable attention_fn, or transformers' attention implementation for its models; and hand
    the recurrent blocks that take one (`sequence_exchange`: the Gated DeltaNet) the head exchange."""
    exchange = UlyssesExchange(cp_mesh.get_group(), cp_mesh.size())
    swapped = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = UlyssesAttention(exchange)
            swapped += 1
        if hasattr(module, "sequence_exchange"):
            module.sequence_exchange = UlyssesHeads(exchange, cp_mesh.get_local_rank())
            swapped += 1
    if swapped:
        return
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        from transformers import AttentionInterface

        # One CP group per process: a second model (DPO's reference) registers the same exchange.
        AttentionInterface.register(HF_ATTENTION, hf_attention(exchange))
        model.set_attn_implementation(HF_ATTENTION)
        return
    if getattr(model, "layers", None):
        raise ConfigError(
            "strategy.cp_style=ulysses needs a registry decoder's attention_fn or a transformers model "
            "(model.arch=hf_auto): use strategy.cp=1 for this model"
        )
