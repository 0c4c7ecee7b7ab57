"""DPO's reference log-probs, one of three ways (objective.reference, objective.precompute_reference):

- adapters off: with LoRA / QLoRA and reference=base, the policy itself with its adapters switched off (a
  second forward, no second copy of the weights);
- a frozen copy: full fine-tuning (or reference=hf:DIR, or reference=RUN_DIR: a dtlaunch run's checkpoint,
  a LoRA run's base with its adapters merged, dtlaunch.convert.run_weights) builds the model once more on the same mesh with
  the same layout (FSDP-sharded when the policy is), never trained: no gradients, no optimizer state, stored
  in the compute dtype;
- precomputed: the loader hands each pair's reference log-probs read from the file written before training
  (dtlaunch.train.objectives.precompute); no reference model is held.

Every reference forward runs under no_grad, before the policy's forward, so its activations are never
kept; with training.loss_chunks its head runs chunk by chunk, as the policy's (no full logits). It reads the batch's model inputs beside the tokens (context parallel: the chunks' positions) and
sums its log-probs over the CP group as the policy's are (train/loss.py). Under pipeline parallel the adapters-off
base and the frozen copy are split into the pipeline's stages, and the forward runs through them
(pipeline_reference.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.config.weight_source import WeightSource
from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.models.lora import adapters_disabled
from dtlaunch.models.registry import model_spec
from dtlaunch.train.loss import completion_logps

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig
    from dtlaunch.train.batch import MicroBatch


class AdaptersOff:
    modules: list = []  # no module of its own (the memory tracker counts the reference's modules)

    def __init__(self, model: nn.Module, cp_group: Optional[Any], head: Any) -> None:
        # DDP's wrapper would prepare a gradient reduction; the wrapped module runs the same forward.
        self.model = getattr(model, "module", model)
        self.cp_group, self.head = cp_group, head

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        with adapters_disabled(self.model):
            out = self.head.model_output(self.model, inputs, **batch.model_inputs(inputs.device))
            return completion_logps(out, targets, self.cp_group, self.head.token_nll).logps


class FrozenCopy:
    def __init__(self, model: nn.Module, cp_group: Optional[Any], head: Any) -> None:
        self.model = model
        self.modules = [model]
        self.cp_group, self.head = cp_group, head

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        out = self.head.model_output(self.model, inputs, **batch.model_inputs(inputs.device))
        return completion_logps(out, targets, self.cp_group, self.head.token_nll).logps


class Precomputed:
    """The batch's `ref_logps`: the (2B,) values of its pairs, read from the precomputed table."""

    modules: list = []

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        assert batch.ref_logps is not None, "a precomputed reference reads the loader's table"
        return batch.ref_logps.to(inputs.device)


def uses_adapters_off(cfg: JobConfig) -> bool:
    return str(cfg.objective.reference) == "base" and str(cfg.peft.method) != "none"


def build_reference(
    cfg: JobConfig, dec: Decisions, mesh: Any, parts: list, live: bool = False, init: bool = True
) -> Optional[Any]:
    """The reference of this rank for objective=dpo / kto (None otherwise). live=True: a model even when
    objective.precompute_reference is set (the precompute pass itself); init=False: a copy allocated
    without values (the planner's trace, as build_runtime). `parts`: the policy's model, or this rank's
    pipeline stage modules in schedule order."""
    if cfg.objective.name not in (ObjectiveName.dpo, ObjectiveName.kto):
        return None
    if bool(cfg.objective.precompute_reference) and not live:
        return Precomputed()
    if dec.layout.pp > 1:
        return _pipeline_reference(cfg, dec, mesh, parts, init)
    from dtlaunch.train.loss import head_loss

    group = cp_group(mesh)
    if uses_adapters_off(cfg):
        return AdaptersOff(parts[0], group, head_loss(dec.loss_chunks, parts))
    copy = frozen_copy(cfg, dec, mesh, _device(parts), init)
    return FrozenCopy(copy, group, head_loss(dec.loss_chunks, [copy]))


def _pipeline_reference(cfg: JobConfig, dec: Decisions, mesh: Any, parts: list, init: bool) -> Any:
    """Under pipeline parallel: the policy's own stages with their adapters off, or a frozen copy split into
    this rank's stages (dtlaunch.train.objectives.pipeline_reference)."""
    from dtlaunch.train.objectives.pipeline_reference import PipelineReference, stage_owners
    from dtlaunch.train.parallel.pipeline import build_stage_modules, stage_ids

    s, pp_mesh, layout = cfg.strategy, mesh["pp"], dec.layout
    rank = pp_mesh.get_local_rank()
    if uses_adapters_off(cfg):
        stages = list(zip(stage_ids(rank, layout.pp, int(s.pp_stages_per_rank), s.pp_schedule), parts, strict=True))
    else:
        model, ref_cfg, weights = _frozen_model(cfg, init)
        stages = [
            (i, _parallelize_frozen(part, mesh, ref_cfg, dec, init, weights))
            for i, part in build_stage_modules(model, ref_cfg, layout, rank)
        ]
    from dtlaunch.train.loss import head_loss

    owners = stage_owners(layout.pp, int(s.pp_stages_per_rank), s.pp_schedule)
    head = head_loss(dec.loss_chunks, [m for _, m in stages], pipeline=True)  # the last stage's, where this rank has it
    return PipelineReference(stages, owners, pp_mesh.get_group(), dec.pp_microbatches, uses_adapters_off(cfg), head)


def cp_group(mesh: Any) -> Optional[Any]:
    """The context-parallel process group of this rank (None without CP, or without a mesh)."""
    from dtlaunch.train.parallel.mesh import sub_mesh

    cp = sub_mesh(mesh, "cp") if mesh is not None else None
    return cp.get_group() if cp is not None else None


def _device(parts: list) -> torch.device:
    return next(p.device for m in parts for p in m.parameters())


def frozen_copy(cfg: JobConfig, dec: Decisions, mesh: Any, device: torch.device, init: bool = True) -> nn.Module:
    """The reference model, parallelised like the policy (without DDP) and initialised: from the same seed
    (reference=base: the policy's initial weights, model.init_from included), from reference=hf:DIR or from
    the checkpoint of reference=RUN_DIR."""
    model, ref_cfg, weights = _frozen_model(cfg, init)
    if mesh is None:  # one process without a mesh (the tests' single-process reference)
        from dtlaunch.train.parallel.init_weights import materialize_and_init

        materialize_and_init(model, device, int(cfg.training.seed), init_source=model, weights=weights)
        return model.eval()
    return _parallelize_frozen(model, mesh, ref_cfg, dec, init, weights)


def _parallelize_frozen(
    model: nn.Module, mesh: Any, ref_cfg: JobConfig, dec: Decisions, init: bool, weights: Any
) -> nn.Module:
    from dtlaunch.train.parallel.parallelize import parallelize

    # ref_cfg differs from the policy's job only in peft.method and model.init_from, which decide nothing there.
    return parallelize(model, mesh, ref_cfg, dec, init=init, frozen=True, weights=weights).eval()


def _frozen_model(cfg: JobConfig, init: bool) -> tuple[nn.Module, JobConfig, Any]:
    """(the reference model on the meta device, its config, the weights to load instead of its init)."""
    from omegaconf import OmegaConf

    ref_cfg = OmegaConf.merge(cfg, {"peft": {"method": "none"}})
    ref, weights = str(cfg.objective.reference), None
    if WeightSource.parse(ref).is_hf:
        ref_cfg.model.init_from = ref
    elif ref != "base" and init:
        from dtlaunch.convert.run_weights import run_weights

        weights = run_weights(ref, cfg.model)
    model = model_spec(ref_cfg.model).build(ref_cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
    dtype = torch_dtype(cfg.precision.param_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    if dtype != torch.float32:
        # Never updated: no fp32 master copy of the linears (nor of a MoE's routed experts), the compute
        # dtype is all their matmuls read (norms and the embedding stay fp32, as the policy's, so both see
        # the same numbers).
        from dtlaunch.train.parallel.frozen_base import compute_dtype_weights

        ids = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
        tied = {i for i in ids if ids.count(i) > 1}  # a head tied to the embedding stays as it is
        for mod in model.modules():
            if isinstance(mod, nn.Embedding):
                continue
            for name in compute_dtype_weights(mod):
                p = getattr(mod, name, None)
                if isinstance(p, nn.Parameter) and p.dtype != dtype and id(p) not in tied:
                    setattr(mod, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
    return model, ref_cfg, weights


class TokenReference:
    """objective=grpo with objective.beta > 0: the reference's per-token log-probs of a rollout's rows, from
    the policy with its adapters off (LoRA / QLoRA) or from a frozen copy of the initial weights."""

    def __init__(self, model: nn.Module, head: Any, adapters_off: bool, temperature: float = 1.0) -> None:
        self.model = getattr(model, "module", model)
        self.head, self.adapters_off, self.temperature = head, adapters_off, temperature
        self.modules = [] if adapters_off else [model]

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            with adapters_disabled(self.model):
                out = self.head.model_output(self.model, inputs)
        else:
            out = self.head.model_output(self.model, inputs)
        from dtlaunch.train.objectives.grpo import token_logps

        return token_logps(out, targets, self.head.token_nll, self.temperature)


def grpo_reference(
    cfg: JobConfig, dec: Decisions, mesh: Any, parts: list, init: bool = True
) -> Optional[TokenReference]:
    """The reference of objective=grpo (None when objective.beta is 0: none is held)."""
    if cfg.objective.name != ObjectiveName.grpo or float(cfg.objective.beta) == 0.0:
        return None
    from dtlaunch.train.loss import head_loss

    temperature = float(cfg.objective.temperature)  # the reference's log-probs are of logits / T too (TRL)
    if str(cfg.peft.method) != "none":
        return TokenReference(parts[0], head_loss(dec.loss_chunks, parts), adapters_off=True, temperature=temperature)
    copy = frozen_copy(cfg, dec, mesh, _device(parts), init)
    return TokenReference(copy, head_loss(dec.loss_chunks, [copy]), adapters_off=False, temperature=temperature)
