"""Low-rank adapters (LoRA) on the linears of a built model; everything else frozen.

An adapted linear keeps its original `weight` (and `bias`) as the frozen base and gains two trainable
parameters, `lora_a` [rank, in] and `lora_b` [out, rank]:

    y = x W^T + b + (alpha / rank) * (dropout(x) A^T) B^T

which is what Hugging Face peft computes, so an adapter trained here loads there unchanged. B starts at
zero (training starts from the base model's outputs), A Kaiming-uniform (torch's nn.Linear default,
bound 1/sqrt(in)) drawn from a generator seeded by the run's seed and the parameter's name: the runtime
computes the full value and cuts each rank's shard from it (dtlaunch.train.parallel.init_weights), so every layout
starts from the same adapters.

Targets are Hugging Face module names (q_proj, v_proj, gate_proj, ...): each linear of the blocks is
named through its family's HF name mapping (`ModelSpec.names().to_hf_name`), so the same
`peft.targets` work for every family. The output head never takes an adapter.

An objective may name modules that train in full beside the adapters (`modules_to_save`, peft's name: a
reward model's `score` head, dtlaunch.models.score_head); their parameters stay trainable, everything else
is frozen.

No torch.distributed here: tensor parallel styles for these linears live in dtlaunch.train.parallel.lora_tp.
"""

from __future__ import annotations

import contextlib
import math
import types
import zlib
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtlaunch.config.schema import LORA_DEFAULT_TARGETS
from dtlaunch.errors import ConfigError

ALL_LINEAR = "all-linear"
# A linear's adapters, and the routed experts' (peft.target_experts: their gate_up and down stacks).
EXPERT_ADAPTER_NAMES = ("lora_gate_up_a", "lora_gate_up_b", "lora_down_a", "lora_down_b")
ADAPTER_NAMES = ("lora_a", "lora_b", *EXPERT_ADAPTER_NAMES)


class LoRALinear(nn.Linear):
    """nn.Linear + adapters. Made by `adapt_linear` (the class of an existing nn.Linear is swapped, so its
    parameters keep their identity and names); `isinstance(m, nn.Linear)` stays true."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    rank: int
    scaling: float
    lora_dropout: float
    # True inside `adapters_disabled`: the base linear alone (DPO's reference is the base model).
    adapters_off: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.adapters_off:
            return out
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x
        return out + self.scaling * F.linear(F.linear(h, self.lora_a), self.lora_b)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def effective_matrix(linear: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """The (in_features, out_features) matrix a bias-free linear multiplies by, its weight's transpose: the
    module run on the identity (in `like`'s dtype and device), so whatever wraps it is included (LoRA's
    adapters, tensor parallel's shard of its outputs, QLoRA's NF4 base), with any adapter's dropout skipped
    (a module in training mode would otherwise drop entries of the identity): the weights' matrix, not one
    draw of it."""
    assert getattr(linear, "bias", None) is None, "a linear with a bias adds it to every row of the identity"
    eye = torch.eye(int(linear.in_features), dtype=like.dtype, device=like.device)
    dropping = [m for m in linear.modules() if isinstance(m, LoRALinear) and m.training and m.lora_dropout > 0]
    for m in dropping:
        m.training = False
    try:
        return linear(eye)
    finally:
        for m in dropping:
            m.training = True


def adapt_linear(linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
    """Turn `linear` into a LoRALinear in place (adapters allocated on the weight's device, meta included;
    values come from `adapter_init`)."""
    if not isinstance(linear, nn.Linear) or isinstance(linear, LoRALinear):
        raise TypeError(f"adapt_linear takes a plain nn.Linear, not {type(linear).__name__}")
    w = linear.weight
    linear.__class__ = LoRALinear
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, device=w.device, dtype=w.dtype))
    linear.lora_b = nn.Parameter(torch.empty(linear.out_features, rank, device=w.device, dtype=w.dtype))
    linear.rank, linear.scaling, linear.lora_dropout = int(rank), float(alpha) / int(rank), float(dropout)
    return linear  # type: ignore[return-value]


def routed_expert_stacks(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> every routed-experts module (3-D w1 / w2 / w3 stacks) inside the blocks."""
    from dtlaunch.models.moe.experts import GroupedExperts

    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts) and _in_block(fqn)}


def adapt_experts(experts: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Adapters on a routed-experts module's gate_up and down stacks, in PEFT's `target_parameters` form
    (dtlaunch.models.moe.experts.GroupedExperts.local_weights): shapes from its w1 / w2, on its device."""
    e, f, dim = experts.w1.shape
    kw = {"device": experts.w1.device}
    experts.lora_gate_up_a = nn.Parameter(torch.empty(e, rank, dim, **kw))
    experts.lora_gate_up_b = nn.Parameter(torch.empty(e, 2 * f, rank, **kw))
    experts.lora_down_a = nn.Parameter(torch.empty(e, rank, f, **kw))
    experts.lora_down_b = nn.Parameter(torch.empty(e, dim, rank, **kw))
    experts.scaling = alpha / rank
    return experts


def _adapted_experts(m: nn.Module) -> bool:
    return getattr(m, "lora_gate_up_a", None) is not None


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every LoRALinear of `model` computes its base linear only (no second copy of the base is needed
    for a reference model); restored on exit."""
    linears = [m for m in model.modules() if isinstance(m, LoRALinear) or _adapted_experts(m)]
    for m in linears:
        m.adapters_off = True
    try:
        yield
    finally:
        for m in linears:
            m.adapters_off = False


def is_adapter(name: str) -> bool:
    """Whether a (model) parameter name is an adapter's: '<linear fqn>.lora_a' / '.lora_b'."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> Optional[torch.Tensor]:
    """The full initial value of adapter `name` (fp32, CPU), None for other parameters."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in ADAPTER_NAMES:
        return None
    if leaf.endswith("_b"):
        return torch.zeros(shape)
    # Its own stream: a different (seed, name) key than any base parameter's.
    g = torch.Generator().manual_seed((seed * 1_000_033 + zlib.crc32(name.encode())) % (2**63))
    # kaiming_uniform_(a=sqrt(5)) over the input features (the last dim; an expert stack's [E, r, in] too), as
    # nn.Linear and peft initialise A.
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.rand(shape, generator=g).mul_(2 * bound).sub_(bound)


def hf_module_name(spec: Any, fqn: str) -> str:
    """The Hugging Face module path of our module `fqn` (the family's mapping of its weight's name)."""
    if not getattr(spec, "hf_names", ""):
        return fqn  # a transformers model (hf_auto) already carries HF names
    return spec.names().to_hf_name(f"{fqn}.weight").rsplit(".", 1)[0]


def candidate_linears(model: nn.Module, spec: Any) -> dict[str, str]:
    """Every linear inside the blocks: our fqn -> its Hugging Face module name (leaf = the target name)."""
    out = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and _in_block(fqn):
            out[fqn] = hf_module_name(spec, fqn)
    return out


def _in_block(fqn: str) -> bool:
    # The protocol's `layers` ModuleDict (hf_auto: the decoder layers under their transformers path).
    parts = fqn.split(".")
    return "layers" in parts[:-1]


def expert_names(model: nn.Module, spec: Any) -> set[str]:
    """HF leaf names of block parameters that are not linears (routed experts' 3-D weights): the error
    says why `gate_proj` is refused on a MoE model, and the peft export why it cannot be written."""
    linear = {f"{fqn}." for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = set()
    for name, p in model.named_parameters():
        if p.dim() < 2 or not _in_block(name) or any(name.startswith(f) for f in linear):
            continue
        try:
            hf = spec.names().to_hf_name(name) if getattr(spec, "hf_names", "") else name
        except (KeyError, ValueError):
            continue
        names.add(hf.rsplit(".", 2)[-2])
    return names


def select_targets(model: nn.Module, spec: Any, targets: Iterable[str], arch: str = "") -> dict[str, str]:
    """fqn -> HF module name of the linears `targets` selects; a name matching none is a ConfigError that
    lists the valid ones for this model."""
    linears = candidate_linears(model, spec)
    valid = sorted({hf.rsplit(".", 1)[-1] for hf in linears.values()})
    default = tuple(str(t) for t in targets) == LORA_DEFAULT_TARGETS
    wanted = spec.lora_targets(targets)
    if not wanted:
        raise ConfigError(f"peft.targets is empty: name modules to adapt, e.g. peft.targets=[{','.join(valid)}]")
    if ALL_LINEAR in wanted:
        return linears
    where = f" of model.arch={arch}" if arch else ""
    experts = expert_names(model, spec)
    if default and (experts or spec.lora_default_extra):
        # The default names the MLP (routed experts here) and the family's own attention names: those it has.
        wanted = [t for t in wanted if t in valid]
    for t in wanted:
        if t in valid:
            continue
        why = " (its routed experts take peft.target_experts=true)" if experts else ""
        raise ConfigError(
            f"peft.targets: '{t}' is not a linear module{where}{why}: use some of {', '.join(valid)} or {ALL_LINEAR}"
        )
    return {fqn: hf for fqn, hf in linears.items() if hf.rsplit(".", 1)[-1] in wanted}


def apply_lora(model: nn.Module, spec: Any, peft: Any, modules_to_save: tuple[str, ...] = ()) -> list[str]:
    """Adapt the linears `peft.targets` names (peft.rank, peft.alpha, peft.dropout), freeze every other
    parameter but those of `modules_to_save` (module fqns that train in full), and route the adapters'
    initial values through the model's `init_param`. Returns the adapted fqns. Works on a meta model,
    before any parallelisation or pipeline split."""
    chosen = select_targets(model, spec, peft.targets, str(getattr(getattr(model, "cfg", None), "arch", "")))
    for fqn in chosen:
        adapt_linear(model.get_submodule(fqn), int(peft.rank), float(peft.alpha), float(peft.dropout))
    if getattr(peft, "target_experts", False):
        for module in routed_expert_stacks(model).values():
            adapt_experts(module, int(peft.rank), float(peft.alpha))
    # Kept on the model: tensor parallel freezes again (freeze_base) after its styles re-create parameters.
    model.lora_modules_to_save = tuple(modules_to_save)
    freeze_base(model)
    base_init = model.init_param

    def init_param(self: nn.Module, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        value = adapter_init(name, shape, seed)
        return value if value is not None else base_init(name, shape, seed)

    # An instance method, as hf_auto's and custom models' init_param are: init.py and init_weights call it.
    model.init_param = types.MethodType(init_param, model)
    return list(chosen)


def freeze_base(model: nn.Module) -> None:
    """Only adapters (and the modules apply_lora was told to save) train. Also after tensor parallel: torch's
    SequenceParallel (and the replication of parameters a style leaves alone) registers new Parameters
    without their requires_grad."""
    saved = getattr(model, "lora_modules_to_save", ())
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or trains_in_full(name, saved))


def trains_in_full(name: str, modules_to_save: Iterable[str]) -> bool:
    """Whether parameter `name` belongs to one of `modules_to_save` (module fqns)."""
    return any(name.startswith(f"{m}.") for m in modules_to_save)
