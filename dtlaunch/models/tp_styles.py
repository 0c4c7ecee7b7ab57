"""Tensor-parallel plans as data: what a model family says about splitting its modules, without torch.

A family's `tp_plan` module returns {module name: style} with the styles below; the worker turns them into
torch's ParallelStyles (dtlaunch.train.parallel.tensor_parallel.parallel_style). Layouts are written
"replicate", "shard(<dim>)" or None (an argument the style leaves alone), as DTensor placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

Layout = Optional[str]


@dataclass(frozen=True)
class Colwise:
    """A linear split on its output features (torch's ColwiseParallel)."""

    input: Layout = "replicate"
    output: Layout = "shard(-1)"
    local_output: bool = True


@dataclass(frozen=True)
class Rowwise:
    """A linear split on its input features; partial outputs reduced into `output` (RowwiseParallel)."""

    input: Layout = "shard(-1)"
    output: Layout = "replicate"
    local_output: bool = True


@dataclass(frozen=True)
class SequenceShard:
    """A module run on its shard of dimension `dim` with replicated weights whose gradients are summed over
    the ranks (torch's SequenceParallel): norms under sequence parallel, per-head norms on head shards."""

    dim: int = 1
    local_output: bool = False


@dataclass(frozen=True)
class PrepareInput:
    """Redistribute a module's positional inputs (PrepareModuleInput)."""

    inputs: tuple[Layout, ...]
    desired: tuple[Layout, ...]
    local_output: bool = True


@dataclass(frozen=True)
class PrepareInputOutput:
    """Redistribute a module's inputs and outputs (PrepareModuleInputOutput)."""

    inputs: tuple[Layout, ...]
    desired_inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    desired_outputs: tuple[Layout, ...]
    local_input: bool = True
    local_output: bool = True


@dataclass(frozen=True)
class VocabEmbedding:
    """A token embedding split on the vocabulary, partial lookups summed into `output`
    (dtlaunch.train.parallel.tensor_parallel.VocabParallel)."""

    output: Layout = "replicate"


@dataclass(frozen=True)
class RoutedExperts:
    """The routed experts (dtlaunch.models.moe.experts.GroupedExperts) split on their hidden width, Megatron's
    column / row split applied to every expert at once (w1, w3 and their biases on their rows, w2 on its
    columns): each rank computes every routed copy through its slice of every expert, and the partial
    outputs are summed before the router's weights combine them
    (dtlaunch.train.parallel.tensor_parallel.ExpertsTensorParallel)."""


@dataclass(frozen=True)
class SumGrad:
    """A module computed whole on every rank whose output each rank uses only in part (DeepSeek-V3's rotated
    key, shared by every head: a rank's heads): its output's gradient is summed over the ranks
    (dtlaunch.train.parallel.tensor_parallel.GradSumOverTP)."""


@dataclass(frozen=True)
class WholeWeights:
    """A module computed with its rows of a weight it reads whole. With `parts`, the weight's rows are those
    parts one after another (Qwen3.5's in_proj_qkv and the Gated DeltaNet's depthwise conv1d, [q | k | v]) and
    each rank computes with its 1/tp slice of every part, the rows of its heads: the weight is stored
    Shard(0) in the one-process layout (checkpoints as one process; optimizer state split), all-gathered for
    each forward and its gradient reduce-scattered. Without, a replicated weight used whole (the gated
    norm's gain, shared by every head), its gradient summed over the ranks. `whole_input`: the module reads
    the replicated residual stream, whose gradient is summed too (a column-parallel linear's input).
    Supports nn.Linear without bias, depthwise nn.Conv1d and the gated RMSNorm
    (dtlaunch.train.parallel.tensor_parallel.WholeWeightsParallel)."""

    parts: tuple[int, ...] = ()
    whole_input: bool = False


Style = (
    Colwise
    | Rowwise
    | SequenceShard
    | PrepareInput
    | PrepareInputOutput
    | VocabEmbedding
    | RoutedExperts
    | SumGrad
    | WholeWeights
)
