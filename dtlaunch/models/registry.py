"""The model registry: every model dtlaunch trains natively is one `ModelSpec` entry, found by `model.arch`.

An entry brings everything model-specific the runtime, planner and converters need, so `train/`,
`plan/` and `convert/` look a model up here instead of importing one:
- `builder`: builds the nn.Module on a device (meta for the runtime);
- `tp_plan`: module name -> style (dtlaunch.models.tp_styles) for the parts outside and inside a block (data);
- wrapping units: the built module's `layers` (see the protocol below), which activation
  checkpointing, compile and FSDP wrap one by one;
- `pipeline_split`: keeps a stage's blocks and the embedding / head on the first / last stage;
- Hugging Face: architecture names, config.json <-> model section, tensor names and layouts;
- planner functions: parameter counts, FLOPs, tensor-parallel divisibility, saved-activation model;
- seeded init: the built module's `init_param(name, full_shape, seed)`;
- its own config fields: `config`, a subclass of the shared ModelConfig that types `model.*` for it.

The protocol a built module follows (the runtime relies on nothing else): a `layers` ModuleDict keyed
by the global block index (pipeline stages delete entries, names stay those of the full model), an
`init_param(name, shape, seed)` giving any parameter's full initial value, `cfg` (the model section)
and `rope_len`; optional top-level modules named by the TP plan are skipped when a stage has them None.

Builders and TP plans are import paths ("module:attr") resolved on first use: this module and the
planner functions are torch-free, so `dtlaunch plan` and `validate` never import torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

from dtlaunch.config.schema import LORA_DEFAULT_TARGETS, ModelConfig
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def _no_experts(m: Any) -> int:
    return 0


def _nothing_whole(m: Any) -> int:
    return 0


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    description: str
    # "module:function" building the model: (model section, rope_len, device) -> nn.Module.
    builder: str
    # "module" with model_plan(m, sp) / block_plan(m, sp) -> {module name: style} (models/tp_styles.py).
    tp_plan: str
    # "module:function" (model, stage index, n_stages, layer range) -> stage module.
    pipeline_split: str
    # Hugging Face: the `architectures` names this entry reads, and its adapter (see models/dense/hf.py):
    # config_from_hf(config.json dict, where) -> model fields, config_to_hf(m, dtype) -> config.json.
    hf_architectures: tuple[str, ...]
    hf: Any
    # "module" with to_hf_state / from_hf_state / to_hf_name (torch-free tensor reshaping).
    hf_names: str
    # Planner (pure Python): parameter counts, FLOPs and the saved-activation model ("module").
    param_count: Callable[[Any], int]
    block_params: Callable[[Any], int]
    block_norm_params: Callable[[Any], int]
    embedding_params: Callable[[Any], int]
    head_params: Callable[[Any], int]
    flops_per_token: Callable[[Any, int], float]
    matmul_params: Callable[[Any], int]
    tp_divisors: Callable[[Any], list]
    # None: no closed-form memory model; the planner traces a step instead (plan/trace.py).
    activations: Optional[str]
    # Model-section fields this family fixes: config groups and config.json must agree with them.
    fixed: dict = field(default_factory=dict)
    # A tied head and embedding live on different pipeline stages: refused with pp > 1.
    pp_tied_ok: bool = False
    # One block's linears, HF name -> (out, in, column-parallel): the planner's LoRA / QLoRA lines.
    block_linears: Optional[Callable[[Any], dict]] = None
    # "module:function" (job config) -> None: the family's own rules on the model section, raising
    # ConfigError with one line (run by `validate` before anything starts).
    check: str = ""
    # "module:function" (job config, its config.decisions.Decisions) -> None: the family's rules on the
    # resolved layout (run by `validate` first of the rules that read the layout).
    check_layout: str = ""
    # The attention is the decoder's own, which context parallel swaps for ring attention.
    ring_attention: bool = True
    # No ring attention, but strategy.cp_style=ulysses: the decoder's own attention and recurrent blocks that
    # take Ulysses' head exchange (the Gated DeltaNet hybrids: GatedDeltaNet.sequence_exchange).
    ulysses_blocks: bool = False
    # (model section, cp, tp) -> whether those blocks split over cp Ulysses ranks at that tensor-parallel degree
    # (the rule the family's check_layout enforces; the plan search offers only those degrees). None: any.
    ulysses_degree_ok: Optional[Callable[[Any, int, int], bool]] = None
    # The attention runs through transformers' attention-function registry (model.arch=hf_auto), where
    # strategy.cp_style=ulysses installs its exchange (ring attention needs the decoder's own).
    hf_attention: bool = False
    # The model section's schema: ModelConfig, or a subclass adding the family's own fields (a field of
    # another family is then an error; dtlaunch/job/model_schema.py).
    config: type = ModelConfig
    # Routed experts per MoE layer of a model section (0: no expert layers; expert parallel needs some).
    routed_experts: Callable[[Any], int] = _no_experts
    # One block's matrices tensor parallel leaves whole on every rank, besides MoE routers (deepseek_v3's
    # low-rank q / kv projections).
    tp_whole_block_params: Callable[[Any], int] = _nothing_whole
    # The family's own names for what peft.targets' default adapts (its names that exist in the model join
    # it): DeepSeek-V3's latent attention has no q_proj / v_proj but q_b_proj (a low-rank query's second half)
    # and kv_b_proj (per-head keys and values).
    lora_default_extra: tuple = ()
    # (model section, tp) -> values one block's decoding cache holds per position and row on one rank
    # (dtlaunch.infer.batch_generate): the planner's KV cache line and decode-step bytes. None: the per-head
    # keys and values, 2 x the kv width split by tensor parallel (DeepSeek-V3 caches its latent instead).
    kv_cache_values: Optional[Callable[[Any, int], float]] = None
    # (model section, tp) -> values one block's attention derives from its weights once per generation and
    # keeps on its decoding cache until the generation ends (KVCache.derived: DeepSeek-V3's absorbed wkv_b
    # matrix, this rank's heads), counted with the KV cache. None: nothing.
    decode_derived_values: Optional[Callable[[Any, int], float]] = None

    def lora_targets(self, targets: Any) -> list[str]:
        """peft.targets as this family reads them: the default with the family's own names added (the one
        place the runtime's selection and the planner's adapter lines take them from)."""
        names = [str(t) for t in targets]
        return [*names, *self.lora_default_extra] if tuple(names) == LORA_DEFAULT_TARGETS else names

    def check_config(self, cfg: JobConfig) -> None:
        if self.check:
            _resolve(self.check)(cfg)

    def check_config_layout(self, cfg: JobConfig, d: Decisions) -> None:
        if self.check_layout:
            _resolve(self.check_layout)(cfg, d)

    def build(self, m: Any, rope_len: Any = None, device: Any = "meta") -> Any:
        from dtlaunch.models.meta_init import SkipRandomInitOnMeta

        with SkipRandomInitOnMeta() if str(device) == "meta" else nullcontext():
            return _resolve(self.builder)(m, rope_len=rope_len, device=device)

    def tp_model_plan(self, m: Any, sequence_parallel: bool) -> dict:
        return _module(self.tp_plan).model_plan(m, sequence_parallel)

    def tp_block_plan(self, m: Any, sequence_parallel: bool) -> dict:
        return _module(self.tp_plan).block_plan(m, sequence_parallel)

    def split_stage(self, model: Any, stage: int, n_stages: int, layers: range) -> Any:
        return _resolve(self.pipeline_split)(model, stage, n_stages, layers)

    @property
    def analytic(self) -> bool:
        """Whether the planner has a closed-form memory model for this entry."""
        return self.activations is not None

    def act(self) -> ModuleType:
        if self.activations is None:
            raise ConfigError(f"model '{self.arch}' has no closed-form memory model: plan it by trace")
        return _module(self.activations)

    def names(self) -> ModuleType:
        return _module(self.hf_names)


def traced_spec(
    arch: str, description: str, builder: str, tp_plan: str = "", check: str = "", hf_attention: bool = False
) -> ModelSpec:
    """An entry with no closed-form shapes or pipeline split (and a tensor-parallel plan only where
    `tp_plan` names one): sizes are counted on the meta device (so it imports torch and the module) and
    the planner traces one real step."""

    def count(m: Any) -> int:
        return sum(p.numel() for p in _resolve(builder)(m, device="meta").parameters())

    return ModelSpec(
        arch=arch,
        description=description,
        builder=builder,
        tp_plan=tp_plan,
        pipeline_split="",
        hf_architectures=(),
        hf=None,
        hf_names="",
        param_count=count,
        block_params=lambda m: 0,
        block_norm_params=lambda m: 0,
        embedding_params=lambda m: 0,
        head_params=lambda m: 0,
        # Weights only: the module's attention cost is not known in closed form.
        flops_per_token=lambda m, seq_len: 6.0 * count(m),
        matmul_params=count,
        tp_divisors=lambda m: [],
        activations=None,
        check=check,
        ring_attention=False,
        hf_attention=hf_attention,
    )


_REGISTRY: dict[str, ModelSpec] = {}
_BUILTIN = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "smollm3",
    "olmo3",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "moe",
    "hf_auto",
)


def register(spec: ModelSpec) -> ModelSpec:
    if spec.arch in _REGISTRY and _REGISTRY[spec.arch] is not spec:
        raise ValueError(f"model arch '{spec.arch}' is registered twice")
    _REGISTRY[spec.arch] = spec
    return spec


def _load_builtin() -> None:
    for family in _BUILTIN:
        importlib.import_module(f"dtlaunch.models.{family}")


def registry() -> dict[str, ModelSpec]:
    if not all(a in _REGISTRY for a in _BUILTIN):
        _load_builtin()
    return dict(_REGISTRY)


def known_archs() -> list[str]:
    return sorted(registry())


def model_spec(m: Any) -> ModelSpec:
    """The entry for a model section (a config node, a plain dict or a namespace) or an arch name;
    `model._target_` selects the user-module entry."""
    if isinstance(m, str):
        return _by_arch(m)
    get = m.get if isinstance(m, Mapping) else lambda key: getattr(m, key, None)
    if get("_target_"):
        return _module("dtlaunch.models.custom").SPEC
    module = str(get("family_module") or "")
    if module:
        load_family(module)
    return _by_arch(str(get("arch") or "llama"))


def meta_model(m: Any) -> Any:
    """The model of section `m` on the meta device, for its parameter names and shapes only (rules, converters).
    A config node is read as its plain dataclass first: a block reads its fields many times, and OmegaConf's
    attribute access made a 70B build 0.39 s instead of 0.12 (a QLoRA job's validate built it twice)."""
    if type(m).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        m = OmegaConf.to_object(m)
    return model_spec(m).build(m, rope_len=1, device="meta")


def routed_experts(m: Any) -> int:
    """Routed experts per MoE layer of a model section, as its family counts them (0: none)."""
    return model_spec(m).routed_experts(m)


def _by_arch(arch: str) -> ModelSpec:
    # The planner's search asks ~10^5 times: a registered arch is returned without copying the registry.
    spec = _REGISTRY.get(arch)
    if spec is not None:
        return spec
    specs = registry()
    if arch not in specs:
        raise ConfigError(f"model.arch='{arch}' is not a registered model: use one of {', '.join(sorted(specs))}")
    return specs[arch]


def load_family(module: str) -> None:
    """Import a family of the user's (`model.family_module`): importing it registers its entry."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # any import failure of user code is bad input here
        raise ConfigError(
            f"model.family_module='{module}': cannot import it ({type(exc).__name__}: {exc}): "
            f"make it importable (PYTHONPATH) or fix the name"
        ) from exc


def spec_for_hf(architectures: list[str], where: str) -> ModelSpec:
    """The entry reading a config.json's `architectures`; the error names the known ones."""
    for spec in registry().values():
        if any(a in spec.hf_architectures for a in architectures or []):
            return spec
    known = sorted(a for s in registry().values() for a in s.hf_architectures)
    raise ConfigError(
        f"{where}: architecture {', '.join(architectures or ['(none)'])} is not one dtlaunch builds natively "
        f"(known: {', '.join(known)}): use model.arch=hf_auto for other causal LMs (transformers builds them)"
    )


def _module(path: str) -> ModuleType:
    return importlib.import_module(path)


def _resolve(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
