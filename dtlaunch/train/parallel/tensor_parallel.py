"""Tensor parallel (Megatron-style) with optional sequence parallel, and the loss on sharded logits.

The plan is data, module name -> style (dtlaunch.models.tp_styles), brought by the model's registry entry
(for the dense decoder dtlaunch/models/dense/tp_plan.py), turned into torch's ParallelStyles here
(`parallel_style`) and applied with `parallelize_module`. Names of modules a
pipeline stage does not own (tok_embeddings / norm / output set to None, deleted blocks) are skipped,
so the same plan serves a full model and any pipeline stage.

Activation layouts between blocks:
- sequence parallel: the residual stream is sharded on the sequence (Shard(1)); norms run on their
  sequence shard; attention / feed-forward inputs are all-gathered, their outputs reduce-scattered.
- without it: the residual stream is replicated; only the linear layers are split.
In both cases the logits stay sharded on the vocabulary (Shard(-1)) and the loss runs on them under
`loss_parallel()` (dtlaunch.train.loss.loss_context), so no rank ever holds the full (B, S, V) logits.

The token embedding is vocabulary-parallel (`VocabParallel`): each rank holds V/tp rows, looks up the
tokens that fall in them and the partial outputs are summed. Not torch's RowwiseParallel: its
DTensor backward builds the embedding gradient REPLICATED, a full V x h tensor on every rank that is
then cut down to the rank's shard (measured: 4x the shard's bytes at tp=4; on Llama-3.1-70B at tp=8
a 2 GiB bf16 transient per GPU at the end of backward, and the dense V x h scatter-add with it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtlaunch.models import tp_styles as styles
from dtlaunch.models.local_tensor import local_tensor
from dtlaunch.models.moe.experts import GroupedExperts
from dtlaunch.models.qwen3_next.gated_deltanet import GatedRMSNorm, gated_rms_norm

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


class VocabParallel(ParallelStyle):
    """Shard an nn.Embedding on the vocabulary (weight: Shard(0) DTensor, as RowwiseParallel stores it, so
    checkpoints and FSDP see the same parameter) and run the lookup on local tensors: out-of-shard
    tokens read row 0 and are zeroed, the per-rank partial outputs are summed into `output_layout`
    (Replicate: all-reduce; Shard(1): reduce-scatter over the sequence). Backward then produces only the
    local rows' gradient."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallel shards nn.Embedding, not {type(module).__name__}")
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        module.__class__ = _VocabParallelEmbedding
        module.tp_mesh = device_mesh
        module.output_layout = self.output_layout
        return module


class _VocabParallelEmbedding(nn.Embedding):
    tp_mesh: DeviceMesh
    output_layout: Placement

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # Under FSDP the gathered weight is a DTensor on the TP mesh; its local part is this rank's rows.
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        # torch.chunk's split (what Shard(0) uses): ceil(V / tp) rows per rank, the last ones fewer.
        rows = -(-int(weight.shape[0]) // self.tp_mesh.size())
        first = rows * self.tp_mesh.get_local_rank()
        shifted = tokens - first
        outside = (shifted < 0) | (shifted >= local.shape[0])
        out = F.embedding(shifted.masked_fill(outside, 0), local)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(self.tp_mesh, [self.output_layout]).to_local()


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group (Megatron's `f`): the
    input of a computation each rank does for its slice of the weights, whose input gradient is then a
    partial sum on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Forward sums the ranks' partial outputs over the tensor-parallel group; backward is the identity
    (Megatron's `g`): every rank's partial output took part with weight one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class ExpertsTensorParallel(ParallelStyle):
    """Tensor parallel inside the routed experts (a `GroupedExperts`): w1 / w3 (and gpt-oss's b1 / b3) as
    Shard(1) DTensors (each rank holds hidden / tp rows of every expert), w2 as Shard(2), b2 replicated.
    The router stays whole and computes the same choice on every rank, so every rank runs every routed
    copy through its slices; the partial outputs are all-reduced where the experts return (the combine
    multiplies them by the router's weights, whose gradient must see the whole output) and b2 is added
    once, after the sum. The input's gradient is summed over the ranks (each saw its slices only).
    The all-reduce carries the top_k routed copies ([T * k, dim]), k times what summing after the combine
    would, in exchange for a router and combine untouched by tensor parallel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"ExpertsTensorParallel splits GroupedExperts, not {type(module).__name__}")
        dims = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1, "b2": None}
        for name, dim in dims.items():
            p = getattr(module, name)
            if p is None:
                continue
            placements = [Replicate()] if dim is None else [Shard(dim)]
            t = distribute_tensor(p, device_mesh, placements, src_data_rank=self.src_data_rank)
            setattr(module, name, nn.Parameter(t, requires_grad=p.requires_grad))
        module.__class__ = _TensorParallelExperts
        module.tp_group = device_mesh.get_group()
        return module


class _TensorParallelExperts(GroupedExperts):
    """`GroupedExperts` after ExpertsTensorParallel (its class swapped in place: the parameter names, and so
    the checkpoints, stay the experts')."""

    tp_group: object

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        x = _SumGradOverTP.apply(x, self.tp_group)
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        biases = None if self.b1 is None else (local_tensor(self.b1), None, local_tensor(self.b3))
        out = _SumOverTP.apply(self.compute(x, num_tokens_per_expert, w1, w2, w3, biases), self.tp_group)
        if self.b2 is None:
            return out
        # Each row's expert, without reading the counts on the host (output_size: no sync).
        counts = num_tokens_per_expert
        expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0])
        return out + local_tensor(self.b2).to(out.dtype)[expert]


class GradSumOverTP(ParallelStyle):
    """A module every rank computes whole, each using its output only for its own shards: the output's
    gradient, a partial sum on every rank, is summed over the tensor-parallel group (Megatron's `f` on the
    module's output; no parameters are touched)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda _m, _inputs, out: _SumGradOverTP.apply(out, group))
        return module


class WholeWeightsParallel(ParallelStyle):
    """A module computed with its rows of a weight it reads whole, its class swapped in place (the parameter
    names, and so the checkpoints, stay the module's).

    `parts`: the weight's rows are fused parts one after another (the Gated DeltaNet's [q | k | v]) and the
    rank computes with the r-th of tp equal slices of each (its heads'), which no one DTensor placement
    holds. It is stored as a plain Shard(0) DTensor (tp-th of the rows in the one-process layout, so FSDP,
    DCP and the Hugging Face export see the tensor one process has, and the optimizer state is split),
    all-gathered for each forward (as FSDP gathers a unit) and cut to the rank's slices; the gradient, each
    rank's over its rows only, is reduce-scattered back to the shards. No parts: a replicated DTensor used
    whole (the gated norm's gain, shared by every head), its gradient summed over the ranks (`_SumGradOverTP`).
    `whole_input`: the input's gradient is summed too (the replicated residual stream read by a column-split
    linear)."""

    def __init__(self, parts: tuple[int, ...] = (), whole_input: bool = False) -> None:
        super().__init__()
        self.parts, self.whole_input = tuple(parts), whole_input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        swap = {nn.Linear: _WholeWeightsLinear, nn.Conv1d: _WholeWeightsConv1d, GatedRMSNorm: _WholeWeightsNorm}
        cls = swap.get(type(module))
        if cls is None:
            raise TypeError(f"WholeWeightsParallel takes {', '.join(c.__name__ for c in swap)}, not {type(module)}")
        if getattr(module, "bias", None) is not None:
            raise ValueError("WholeWeightsParallel: a module with a bias")
        if isinstance(module, nn.Conv1d) and not module.groups == module.in_channels == module.out_channels:
            raise ValueError("WholeWeightsParallel: a convolution that is not depthwise")
        p = module.weight
        stored = [Shard(0)] if self.parts else [Replicate()]
        t = distribute_tensor(p, device_mesh, stored, src_data_rank=self.src_data_rank)
        module.weight = nn.Parameter(t, requires_grad=p.requires_grad)
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        spans, start = [], 0
        for n in self.parts:
            if n % tp:
                raise ValueError(f"WholeWeightsParallel: a part of {n} rows does not split in {tp}")
            spans.append((start + rank * (n // tp), n // tp))
            start += n
        if self.parts and start != p.shape[0]:
            raise ValueError(f"WholeWeightsParallel: parts {self.parts} do not add up to {p.shape[0]} rows")
        module.__class__ = cls
        module.tp_group, module.tp_spans, module.tp_whole_input = device_mesh.get_group(), spans, self.whole_input
        return module


class _WholeWeights:
    weight: torch.Tensor
    tp_group: object
    tp_spans: list[tuple[int, int]]
    tp_whole_input: bool

    def _tp_weight(self) -> torch.Tensor:
        """This rank's rows of the weight: of its parts, gathered whole (the gradient, partial on every rank,
        reduce-scattered to the shards); without parts, the replicated weight (its gradient summed)."""
        if not self.tp_spans:
            return _SumGradOverTP.apply(local_tensor(self.weight), self.tp_group)
        w = self.weight
        assert isinstance(w, DTensor), "WholeWeightsParallel's parts: a Shard(0) DTensor weight"
        whole = w.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return torch.cat([whole.narrow(0, a, n) for a, n in self.tp_spans])

    def _tp_input(self, x: torch.Tensor) -> torch.Tensor:
        return _SumGradOverTP.apply(x, self.tp_group) if self.tp_whole_input else x


class _WholeWeightsLinear(_WholeWeights, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._tp_input(x), self._tp_weight())


class _WholeWeightsConv1d(_WholeWeights, nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._tp_weight()
        return F.conv1d(self._tp_input(x), w, None, self.stride, self.padding, self.dilation, w.shape[0])


class _WholeWeightsNorm(_WholeWeights, GatedRMSNorm):
    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(self._tp_input(x), gate, self._tp_weight(), self.eps)


def placement(layout: styles.Layout) -> Placement | None:
    """ "replicate" / "shard(<dim>)" / None as a DTensor placement."""
    if layout is None:
        return None
    if layout == "replicate":
        return Replicate()
    if layout.startswith("shard(") and layout.endswith(")"):
        return Shard(int(layout[len("shard(") : -1]))
    raise ValueError(f"unknown tensor-parallel layout '{layout}' (replicate, shard(<dim>) or None)")


def _placements(layouts: tuple[styles.Layout, ...]) -> tuple[Placement | None, ...]:
    return tuple(placement(x) for x in layouts)


def parallel_style(style: styles.Style) -> ParallelStyle:
    """A model family's style (data) as torch's ParallelStyle."""
    if isinstance(style, styles.Colwise):
        return ColwiseParallel(
            input_layouts=placement(style.input),
            output_layouts=placement(style.output),
            use_local_output=style.local_output,
        )
    if isinstance(style, styles.Rowwise):
        return RowwiseParallel(
            input_layouts=placement(style.input),
            output_layouts=placement(style.output),
            use_local_output=style.local_output,
        )
    if isinstance(style, styles.SequenceShard):
        return SequenceParallel(sequence_dim=style.dim, use_local_output=style.local_output)
    if isinstance(style, styles.PrepareInput):
        return PrepareModuleInput(
            input_layouts=_placements(style.inputs),
            desired_input_layouts=_placements(style.desired),
            use_local_output=style.local_output,
        )
    if isinstance(style, styles.PrepareInputOutput):
        return PrepareModuleInputOutput(
            input_layouts=_placements(style.inputs),
            desired_input_layouts=_placements(style.desired_inputs),
            use_local_input=style.local_input,
            output_layouts=_placements(style.outputs),
            desired_output_layouts=_placements(style.desired_outputs),
            use_local_output=style.local_output,
        )
    if isinstance(style, styles.VocabEmbedding):
        return VocabParallel(output_layout=placement(style.output))
    if isinstance(style, styles.RoutedExperts):
        return ExpertsTensorParallel()
    if isinstance(style, styles.SumGrad):
        return GradSumOverTP()
    if isinstance(style, styles.WholeWeights):
        return WholeWeightsParallel(parts=style.parts, whole_input=style.whole_input)
    raise TypeError(f"not a tensor-parallel style: {style!r}")


def torch_plan(plan: dict[str, styles.Style]) -> dict[str, ParallelStyle]:
    return {name: parallel_style(style) for name, style in plan.items()}


def shard_head_parameters(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parameters a module names in `head_parameters` (one entry per query head: gpt-oss's sinks) become
    Shard(0) DTensors, so each rank holds its heads' entries (the column-parallel q projection gave it
    those heads)."""
    for module in block.modules():
        for name in getattr(module, "head_parameters", ()):
            p = getattr(module, name)
            t = distribute_tensor(p, tp_mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(t, requires_grad=p.requires_grad))


def _has_module(root: nn.Module, name: str) -> bool:
    try:
        return root.get_submodule(name) is not None
    except AttributeError:
        return False


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, cfg: JobConfig) -> None:
    """Shard `model` (a full model or a pipeline stage of one) over `tp_mesh` in place, with the
    plan of its registry entry."""
    from dtlaunch.models.registry import model_spec

    spec = model_spec(cfg.model)
    sp = bool(cfg.strategy.sequence_parallel)
    top = {
        n: s for n, s in torch_plan(spec.tp_model_plan(cfg.model, sp)).items() if getattr(model, n, None) is not None
    }
    float8 = cfg.precision.float8 != "none"
    if float8:  # float8 linears (converted before TP) take torchao's styles: dtlaunch.train.parallel.float8
        from dtlaunch.train.parallel.float8 import float8_tp_plan
    if top:
        parallelize_module(model, tp_mesh, float8_tp_plan(top, model) if float8 else top)
    block = torch_plan(spec.tp_block_plan(cfg.model, sp))
    # An entry whose modules keep head counts as attributes fixes them to this rank's share.
    localize = getattr(importlib.import_module(spec.tp_plan), "localize_heads", None)
    # LoRA linears take styles that also place their adapters: dtlaunch.train.parallel.lora_tp.
    from dtlaunch.train.parallel.lora_tp import lora_tp_plan

    for layer in model.layers.values():
        # A family's plan may name modules only some blocks have (an MoE model's dense and sparse FFNs).
        own = {n: s for n, s in block.items() if _has_module(layer, n)}
        parallelize_module(layer, tp_mesh, lora_tp_plan(float8_tp_plan(own, layer) if float8 else own, layer))
        shard_head_parameters(layer, tp_mesh)
        if localize is not None:
            localize(layer, cfg.model, tp_mesh.size())
    if getattr(cfg, "peft", None) is not None and str(cfg.peft.method) != "none":
        from dtlaunch.models.lora import freeze_base

        freeze_base(model)  # the styles re-create some parameters (norms) as trainable ones
    if getattr(cfg.model, "tie_embeddings", False) and getattr(model, "output", None) is not None:
        # Each style distributed its own copy of the shared matrix; both are Shard(0) on the vocabulary,
        # so the head can use the embedding's DTensor again and the two stay one parameter.
        model.output.weight = model.tok_embeddings.weight
