"""The output projection and the cross-entropy, run chunk by chunk over the tokens (training.loss_chunks).

A full-vocabulary pass holds the (tokens x V) logits, their fp32 upcast, log_softmax's fp32 output and,
in backward, two fp32 gradients of the same size: on a 128k vocabulary the largest tensors of a step.
With loss_chunks = n the model stops before its head (the decoder's `hidden_only` switch: model code
stays free of distributed code) and this module applies the head's weight to 1/n of the tokens at a
time. By default (dtlaunch.train.fused_linear_ce) each chunk's gradients are taken in forward, while its
logits exist: what stays until backward is the hidden states' gradient and the head's weight gradient,
accumulated in place over the chunks, and no FLOP is added. Where a pipeline schedule can run other
micro-batches between a loss's forward and its backward, or the tensors are DTensors (tensor parallel),
each chunk runs under non-reentrant activation checkpointing instead: forward keeps only the chunk's
loss, and backward recomputes that chunk's logits, differentiates them and frees them before the next
chunk. There what stays is the final norm's output (saved for the recompute), one chunk's logits and
gradients, and the head's weight gradient; the cost is one more head matmul per token (about
2 h·V / (6 · parameters) of a step's FLOPs).

Chunking happens before the projection, so the full logits never exist, not even in the compute dtype.
The same code serves every layout:
- DDP / one process: the head's weight is the plain parameter; autocast (compute_context) must cover
  the call, and checkpointing replays it in the recompute.
- FSDP2, head a unit of its own (the frozen, untied head of LoRA / QLoRA: parallel.frozen_base; the
  trained, untied head of full fine-tuning without TP: parallel.head_unit): the
  whole chunked loss runs as that unit's forward (the head called with the targets), so FSDP's own
  hooks gather the head before it and reshard it after; in backward the hook on the loss gathers it again
  (the recompute needs it; the fused loss only scales its saved gradient then) and the hook on the hidden
  states reshards it. The head is gathered only while the loss runs, in ZeRO-2 and ZeRO-3 alike.
- FSDP2, head in the root unit (a tied or tensor-parallel head): called after the root module's
  forward, which (ZeRO-3) has resharded the root unit (embedding, norm, head): the loss gathers it again
  (`unshard`), as the root's pre-backward would, so the weight read here is the gathered parameter and
  its gradient reaches FSDP's reduce-scatter.
- Tensor parallel: the weight is a Shard(0) (vocabulary) DTensor; the hidden states are brought to
  Replicate once (an all-gather under sequence parallel, as the head's own input style does), each
  chunk's logits are Shard(-1) and its loss runs under loss_parallel (the caller's loss_context).
- Pipeline: the last stage's loss_fn (dtlaunch.train.parallel.pp_step.PipelineLoss wraps a HeadLoss).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from dtlaunch.config.layout import loss_chunks
from dtlaunch.errors import ConfigError
from dtlaunch.train.data import IGNORE_INDEX as IGNORE  # masked (chat) targets: see TokenLoader.next_batch
from dtlaunch.train.fused_linear_ce import linear_cross_entropy
from dtlaunch.train.parallel.tensor_parallel import cross_entropy


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of one chunk, summed or per token ("none"): (T, h) hidden, (V, h) head weight, (T,)
    targets. fp32 softmax, as cross_entropy does on full logits."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction=reduction, ignore_index=IGNORE)


def _chunk_by_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int, remat: bool, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of (T, h) hidden states, summed or per token ("none": a (T,) plain tensor), each chunk
    checkpointed (`remat`) or not (no grad)."""
    parts: list[torch.Tensor] = []
    for h_c, t_c in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks), strict=True):
        if t_c.numel() == 0:
            continue
        if remat:
            part = checkpoint(_chunk_loss, h_c, weight, t_c, reduction, use_reentrant=False)
        else:
            part = _chunk_loss(h_c, weight, t_c, reduction)
        if reduction == "none" and isinstance(part, DTensor):
            part = part.to_local()  # replicated under loss_parallel: the local values are the whole (gradient too)
        parts.append(part)
    assert parts, "no tokens"
    return torch.cat(parts) if reduction == "none" else sum(parts[1:], start=parts[0])


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunks: int,
    reduction: str = "mean",
    fused: bool = True,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets) for (B, S, h) hidden and (B, S) targets, `chunks` token
    chunks at a time. reduction "mean" (over targets that count), "sum", or "none": the (B * S,) per-token
    values (the preference objectives' log-probs, dtlaunch.train.objectives.logps), always recomputed in
    backward (their gradient is not known until every row's sum is). `fused`: where the tensors are
    plain, take the gradients in forward (dtlaunch.train.fused_linear_ce) instead of recomputing each
    chunk in backward; False where backward may not follow forward directly (a pipeline stage)."""
    if isinstance(weight, DTensor) and not isinstance(hidden, DTensor):
        # Tensor parallel without sequence parallel: every rank holds the whole (replicated) hidden state.
        hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
    elif isinstance(hidden, DTensor):
        hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
    flat_h, flat_t = hidden.flatten(0, 1), targets.flatten(0, 1)
    # Gradients need the recompute (or the fused forward); without them (validation) each chunk's logits
    # are simply freed.
    remat = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction '{reduction}': use mean, sum or none")
    if remat and fused and reduction != "none" and not isinstance(weight, DTensor):
        total = linear_cross_entropy(flat_h, weight, flat_t, chunks)
    else:
        total = _chunk_by_chunk(flat_h, weight, flat_t, chunks, remat, "none" if reduction == "none" else "sum")
    if reduction != "mean":
        return total
    # F.cross_entropy's mean: over the targets that count (0/0 = nan when none does, as there).
    return total / (flat_t != IGNORE).sum()


def _inner(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 and TP act in place)."""
    return getattr(model, "module", model)


def head_module(model: nn.Module) -> Optional[nn.Module]:
    """The output head of a model (or pipeline stage) that can return its hidden states instead of its
    logits (a `hidden_only` switch); None for a stage without the head."""
    inner = _inner(model)
    if hasattr(inner, "output"):  # the native decoder's name; None on a pipeline stage without the head
        return inner.output
    get = getattr(inner, "get_output_embeddings", None)  # transformers' models (model.arch=hf_auto)
    return get() if callable(get) else None


def _run_loss_in_forward(head: nn.Module) -> None:
    """Let the head's FSDP unit run the whole chunked loss as its forward: `head(hidden, targets, chunks,
    reduction)` (called with the hidden states alone it is the plain head). Through the module's own call
    every hook-based tool sees the loss as the head's forward: FSDP gathers the head once for all the
    chunks (and once again in backward) and frees it after; torch's memory trackers follow the unit."""
    if getattr(head, "runs_chunked_loss", False):
        return  # installed by an earlier head_loss over the same model
    plain = type(head).forward

    def forward(
        hidden: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        chunks: int = 1,
        reduction: str = "mean",
        fused: bool = True,
    ) -> torch.Tensor:
        if targets is None:
            return plain(head, hidden)
        # Read here, inside the unit's forward: the gathered parameter, not the shard.
        return chunked_cross_entropy(hidden, head.weight, targets, chunks, reduction, fused)

    head.forward = forward
    head.runs_chunked_loss = True


class HeadLoss:
    """The loss of the layer set that ends with the output head: plain cross_entropy on the logits the
    model returns (loss_chunks = 1), or the chunked projection + loss on its hidden states (`fused`:
    gradients taken in forward, see chunked_cross_entropy)."""

    def __init__(self, model: Optional[nn.Module], chunks: int, fused: bool = True) -> None:
        self.model, self.chunks, self.fused = model, chunks, fused
        head = head_module(model) if model is not None else None
        # The head as an FSDP unit of its own (not the root's): the loss runs inside that unit.
        self.unit = head if chunks > 1 and isinstance(head, FSDPModule) and head is not model else None
        if self.unit is not None:
            _run_loss_in_forward(self.unit)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.chunks == 1 or self.model is None:
            return cross_entropy(output, targets, reduction=reduction)
        if self.unit is not None:
            return self.unit(output, targets, self.chunks, reduction, self.fused)
        if isinstance(self.model, FSDPModule):
            # ZeRO-3 reshards the root unit (embedding, norm, head) after its forward, and it would only
            # gather it again at its pre-backward: gather it now (a no-op when still gathered, ZeRO-2),
            # so the weight read below is the unsharded parameter whose gradient FSDP reduce-scatters.
            self.model.unshard()
        head = head_module(self.model)
        loss = chunked_cross_entropy(output, head.weight, targets, self.chunks, reduction, self.fused)
        if isinstance(self.model, FSDPModule) and not torch.is_grad_enabled():
            self.model.reshard()  # validation: no backward will reshard the root unit gathered above
        return loss

    def token_nll(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy: what the preference objectives' log-probs are made of
        (dtlaunch.train.objectives.logps), chunk by chunk like the loss."""
        return self(output, targets, reduction="none")


def head_loss(cfg: Any, model_parts: list[nn.Module], pipeline: bool = False) -> HeadLoss:
    """The loss for these model parts (this rank's), switching the part with the head to return hidden
    states when training.loss_chunks > 1. A model without the switch is refused, not run unchunked.
    `pipeline`: the last stage of a pipeline, whose schedule may run other micro-batches between a loss's
    forward and its backward (the chunks are then recomputed in backward, not differentiated in forward)."""
    chunks = loss_chunks(cfg)
    if chunks > 1:
        for part in model_parts:
            inner = _inner(part)
            if not hasattr(inner, "hidden_only"):
                raise ConfigError(
                    f"training.loss_chunks={chunks}: the model ({type(inner).__name__}) returns logits only "
                    f"(no `hidden_only` switch, see docs/models.md): set training.loss_chunks=1"
                )
    owner = next((p for p in model_parts if head_module(p) is not None), None)
    if chunks > 1 and owner is not None:
        if getattr(head_module(owner), "bias", None) is not None:
            raise ConfigError(f"training.loss_chunks={chunks}: the output head has a bias: set training.loss_chunks=1")
        _inner(owner).hidden_only = True
    return HeadLoss(owner, chunks, fused=not pipeline)
