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
    raise TypeError(f"not a tensor-parallel style: {style!r}")


def torch_plan(plan: dict[str, styles.Style]) -> dict[str, ParallelStyle]:
    return {name: parallel_style(style) for name, style in plan.items()}


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
        parallelize_module(layer, tp_mesh, lora_tp_plan(float8_tp_plan(block, layer) if float8 else block, layer))
        if localize is not None:
            localize(layer, cfg.model, tp_mesh.size())
    if getattr(cfg, "peft", None) is not None and str(cfg.peft.method) != "none":
        from dtlaunch.models.lora import freeze_base

        freeze_base(model)  # the styles re-create some parameters (norms) as trainable ones
    if getattr(cfg.model, "tie_embeddings", False) and getattr(model, "output", None) is not None:
        # Each style distributed its own copy of the shared matrix; both are Shard(0) on the vocabulary,
        # so the head can use the embedding's DTensor again and the two stay one parameter.
        model.output.weight = model.tok_embeddings.weight
