"""The loss of a training step, in every form it takes: plain cross-entropy, loss parallel's context,
the chunked head + cross-entropy (recomputed per chunk, or with its gradients taken in forward), and the
pipeline's last-stage loss. `head_loss` picks the form for the runtime's model parts; the step
(dtlaunch.train.step) only calls it.

Plain: `cross_entropy` on the (B, S, V) logits, upcast to fp32 (a bf16 softmax over a large vocabulary
loses precision), as in Meta's and torchtitan's recipes. Targets equal to -100 (masked chat data) do not
count. Under tensor parallel the logits are a Shard(-1) (vocabulary) DTensor and the loss, forward and
backward, runs under `loss_parallel()` (`loss_context`), so no rank ever holds the full logits.

Chunked (training.loss_chunks = n > 1). A full-vocabulary pass holds the (tokens x V) logits, their fp32
upcast, log_softmax's fp32 output and, in backward, two fp32 gradients of the same size: on a 128k
vocabulary the largest tensors of a step. With loss_chunks = n the model is called with `head=False` and
stops before its head (`HeadLoss.model_output` asks for the form the loss takes; model code stays free of
distributed code), and this module applies the head's weight to 1/n of the tokens at a time. Chunking happens before the projection, so the full logits
never exist, not even in the compute dtype. Two ways to differentiate a chunk:
- Fused (the default, `LinearCrossEntropy`): the loss is the last thing forward computes and the first
  thing backward differentiates, so each chunk's gradients are taken in forward while its logits exist:
  softmax minus the one-hot target is d(loss)/d(logits), which gives the hidden states' gradient
  (dlogits @ W) and the head weight's (dlogits^T @ h, accumulated in place over the chunks). Backward only
  scales the two saved gradients. Against the recompute this saves one head matmul per token (2·h·V
  FLOPs) and the hidden states it would keep, and the weight's gradient never exists three times at once.
  The same idea as Liger-Kernel's fused linear cross-entropy, in plain torch. Numerics follow
  `F.cross_entropy(F.linear(h, W).float(), t)`: logits in the matmul's dtype, softmax in fp32, dlogits
  cast back to the matmul's dtype for the two gradient matmuls, as autograd does.
- Recomputed: where a pipeline schedule can run other micro-batches between a loss's forward and its
  backward, or the tensors are DTensors (tensor parallel), each chunk runs under non-reentrant activation
  checkpointing: forward keeps only the chunk's loss, backward recomputes that chunk's logits,
  differentiates them and frees them before the next chunk. What stays is the final norm's output, one
  chunk's logits and gradients, and the head's weight gradient; the cost is one more head matmul per
  token (about 2 h·V / (6 · parameters) of a step's FLOPs).

The same chunked code serves every layout:
- DDP / one process: the head's weight is the plain parameter; autocast (compute_context) must cover
  the call, and checkpointing replays it in the recompute.
- FSDP2, head a unit of its own (the frozen, untied head of LoRA / QLoRA: parallel.frozen_base; the
  trained, untied head of full fine-tuning without TP: parallel.head_unit): the whole chunked loss runs as
  that unit's forward (the head called with the targets), so FSDP's own hooks gather the head before it
  and reshard it after; in backward the hook on the loss gathers it again (the recompute needs it; the
  fused loss only scales its saved gradient then) and the hook on the hidden states reshards it. The head
  is gathered only while the loss runs, in ZeRO-2 and ZeRO-3 alike.
- FSDP2, head in the root unit (a tied or tensor-parallel head): called after the root module's forward,
  which (ZeRO-3) has resharded the root unit (embedding, norm, head): the loss gathers it again
  (`unshard`), as the root's pre-backward would, so the weight read here is the gathered parameter and
  its gradient reaches FSDP's reduce-scatter.
- Tensor parallel: the weight is a Shard(0) (vocabulary) DTensor; the hidden states are brought to
  Replicate once (an all-gather under sequence parallel, as the head's own input style does), each
  chunk's logits are Shard(-1) and its loss runs under loss_parallel (the caller's loss_context).
- Pipeline: the last stage's loss_fn, a `PipelineLoss` around the stage's HeadLoss.

Pipeline loss scaling: the schedule sums gradients over its micro-batches (scale_grads=False), and the
step sums them over `grad_accum` micro-steps; so each pipeline micro-batch's loss is multiplied by
1 / (n_microbatches * grad_accum), which makes the accumulated gradient that of the global-batch mean,
exactly as the non-pipelined step does with 1 / grad_accum.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from dtlaunch.errors import ConfigError
from dtlaunch.train.data import IGNORE_INDEX as IGNORE  # masked (chat) targets: see TokenLoader.next_batch

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean token cross-entropy of (B, S, V) logits against (B, S) targets, in fp32. Under TP the logits
    are a Shard(-1) DTensor and this must run inside `loss_context`; the upcast then stays sharded."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction=reduction)


def loss_context(cfg: JobConfig, layout: Any) -> contextlib.AbstractContextManager:
    """Wrap forward *and* backward of the loss: vocabulary-sharded logits need loss_parallel for both.

    A new context per use: loss_parallel() is a one-shot generator context manager."""
    return loss_parallel() if layout.tp > 1 else contextlib.nullcontext()


def head_loss(chunks: int, model_parts: list[nn.Module], pipeline: bool = False) -> HeadLoss:
    """The loss for these model parts (this rank's): on the part with the head, the hidden states chunk by
    chunk when the job's loss chunks (config.decisions.Decisions.loss_chunks) are more than one, the logits
    otherwise. A model that cannot return its hidden states (no `head` argument) is refused, not run
    unchunked. `pipeline`: the last stage of a pipeline, whose schedule may run other micro-batches between a
    loss's forward and its backward (the chunks are then recomputed in backward, not differentiated in
    forward)."""
    owner = next((p for p in model_parts if head_module(p) is not None), None)
    if chunks > 1:
        for part in model_parts:
            inner = _inner(part)
            if not takes_head_argument(inner):
                raise ConfigError(
                    f"training.loss_chunks={chunks}: the model ({type(inner).__name__}) returns logits only "
                    f"(its forward takes no `head` argument, see docs/models.md): set training.loss_chunks=1"
                )
        if owner is not None and getattr(head_module(owner), "bias", None) is not None:
            raise ConfigError(f"training.loss_chunks={chunks}: the output head has a bias: set training.loss_chunks=1")
    return HeadLoss(owner, chunks, fused=not pipeline)


def takes_head_argument(model: nn.Module) -> bool:
    """Whether `model(tokens, head=False)` returns the hidden states before its head (the plug-in protocol,
    docs/models.md)."""
    return "head" in inspect.signature(model.forward).parameters


class HeadLoss:
    """The loss of the layer set that ends with the output head: plain cross_entropy on the logits the
    model returns (loss_chunks = 1), or the chunked projection + loss on its hidden states (`fused`:
    gradients taken in forward, see chunked_cross_entropy)."""

    def __init__(self, model: Optional[nn.Module], chunks: int, fused: bool = True) -> None:
        self.model, self.chunks, self.fused = model, chunks, fused
        # What the model's forward returns for this loss: the logits, or (chunked) its normed hidden states,
        # asked for per call by the forward's `head=False` (`model_output`, the pipeline's step_kwargs), so
        # the model itself holds no switch.
        self.logits = chunks == 1 or model is None
        self.head_kwargs: dict[str, bool] = {} if self.logits else {"head": False}
        head = head_module(model) if model is not None else None
        # The head as an FSDP unit of its own (not the root's): the loss runs inside that unit.
        self.unit = head if chunks > 1 and isinstance(head, FSDPModule) and head is not model else None
        if self.unit is not None:
            _run_loss_in_forward(self.unit)

    def model_output(self, model: nn.Module, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`model`'s forward on `inputs` as this loss takes it: the logits, or the hidden states before the
        head (a model without the `head` argument is only ever asked for its logits)."""
        return model(inputs, **kwargs, **self.head_kwargs)

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
        (`completion_logps`), chunk by chunk like the loss."""
        return self(output, targets, reduction="none")


def head_module(model: nn.Module) -> Optional[nn.Module]:
    """The output head of a model (or pipeline stage); None for a stage without the head."""
    inner = _inner(model)
    if hasattr(inner, "output"):  # the native decoder's name; None on a pipeline stage without the head
        return inner.output
    get = getattr(inner, "get_output_embeddings", None)  # transformers' models (model.arch=hf_auto)
    return get() if callable(get) else None


def _inner(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 and TP act in place)."""
    return getattr(model, "module", model)


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
    values (the preference objectives' log-probs, `completion_logps`), always recomputed in
    backward (their gradient is not known until every row's sum is). `fused`: where the tensors are
    plain, take the gradients in forward (`LinearCrossEntropy`) instead of recomputing each
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


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of one chunk, summed or per token ("none"): (T, h) hidden, (V, h) head weight, (T,)
    targets. fp32 softmax, as cross_entropy does on full logits."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction=reduction, ignore_index=IGNORE)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (T, h) hidden states projected by a (V, h) weight, over `chunks` token chunks,
    its gradients taken in forward (the module's docstring: "Fused"). Only where the weight and hidden
    states are plain tensors and the loss's backward follows its forward directly: not under tensor
    parallel, whose DTensor losses keep the recompute, nor on a pipeline's last stage, which can hold
    several micro-batches between the two. `dtype`: the matmuls' dtype (autocast's; None = the weight's)."""

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
            # The one-hot's -1 for every chunk's rows, made once: scatter_add_ reads only as many rows of its
            # source as the index has (the first chunk of tensor_split is the longest).
            minus_one = torch.full((-(-hidden.shape[0] // chunks), 1), -1.0, dtype=torch.float32, device=hidden.device)
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
                z.scatter_add_(1, pick, minus_one)
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


class PipelineLoss:
    """The last stage's loss_fn: the loss times `scale` (what backward sees).

    It records nothing itself: torch also calls loss_fn on placeholder outputs while inferring
    backward metadata at the first step, so the real losses are taken from the schedule's `losses=`.
    """

    def __init__(self, loss_fn: HeadLoss, scale: float) -> None:
        self.loss_fn = loss_fn
        self.scale = scale

    @property
    def head_kwargs(self) -> dict[str, bool]:
        """The last stage's forward's `head` argument, if any (HeadLoss.head_kwargs)."""
        return self.loss_fn.head_kwargs

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.scale


def pipeline_loss_fn(loss_fn: HeadLoss, n_microbatches: int, grad_accum: int) -> PipelineLoss:
    """The last stage's loss, scaled by 1 / (n_microbatches * grad_accum) (the module's docstring)."""
    return PipelineLoss(loss_fn, 1.0 / (n_microbatches * grad_accum))


# ---- the preference objectives' completion log-probs -------------------------------------------------
# A preference micro-batch stacks each pair's chosen row above its rejected row as TRL does: rows 0..B-1
# are the chosen completions, rows B..2B-1 the rejected ones, in the same pair order (KTO's examples are
# stacked the same way). Targets that are not completion tokens (the prompt, padding) are -100 and
# contribute nothing. Context parallel: each CP rank holds chunks of every row, so its sums are partial;
# they are summed over the CP group (`SumOverRanks`) before any loss, which every CP rank then computes
# identically. The backward sums the CP ranks' (identical) gradients of that loss: each rank's gradient is
# cp times its share, and the gradient average over the dp_shard_cp mesh (as SFT's) divides the cp back out.


@dataclass
class Completions:
    logps: torch.Tensor  # (2B,) fp32 sums of log p(y_t | y_<t, x) over completion tokens
    tokens: torch.Tensor  # (2B,) completion tokens per row

    def halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) halves of a per-row tensor."""
        return t.chunk(2, dim=0)


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over `group`; backward all-reduces (sums) the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


# The model's output and the targets -> per-token negative log-likelihoods: the chunked head and loss
# (`HeadLoss.token_nll`) where the model returns hidden states.
TokenNLL = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def completion_logps(
    output: torch.Tensor, targets: torch.Tensor, cp_group: Optional[Any] = None, token_nll: Optional[TokenNLL] = None
) -> Completions:
    """Sums over completion tokens of the log-probs of (2B, S) targets (-100: not counted), from (2B, S, V)
    logits, or from the model's hidden states through `token_nll` (training.loss_chunks: the head runs
    chunk by chunk and the full logits never exist).

    Under tensor parallel the logits are vocabulary-sharded and this runs inside `loss_context`; the
    per-token values come back replicated, so every TP rank holds them whole. `cp_group`: the context-
    parallel group whose ranks hold the other chunks of these rows (None without CP)."""
    rows, seq = targets.shape
    nll = token_nll(output, targets) if token_nll is not None else cross_entropy(output, targets, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.to_local()  # replicated: the local value is the whole one (its gradient stays replicated)
    per_token = -nll.view(rows, seq)
    logps, tokens = per_token.sum(dim=1), (targets != IGNORE).sum(dim=1)
    if cp_group is not None:
        logps = SumOverRanks.apply(logps, cp_group)
        dist.all_reduce(tokens, group=cp_group)
    return Completions(logps=logps, tokens=tokens)
