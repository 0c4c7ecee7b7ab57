"""Rules of the `peft` section (LoRA / QLoRA), run by `validate` before any worker starts.

peft.rank, peft.alpha and peft.dropout have their ranges in job/ranges.py. Here: the pairs that do
not go together, and the target names, which only the model can judge: the model is built on the meta
device (no memory; torch is imported only when peft.method is not none) and its linears are named
through the family's Hugging Face mapping, so the error lists exactly the names this model accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig

QLORA_DTYPES = ("bf16", "fp32")


def check_peft(cfg: JobConfig, notes: list[str]) -> None:
    peft = cfg.peft
    method = str(peft.method)
    if method == "none":
        return
    m = cfg.model
    if getattr(m, "_target_", ""):
        raise ConfigError(
            f"peft.method={method} adapts registry models only, not model._target_={m._target_}: "
            "set peft.method=none or use a registered model.arch"
        )
    if str(m.arch) == "hf_auto":
        raise ConfigError(
            f"peft.method={method} is not supported with model.arch=hf_auto: use a natively built family "
            "(llama, qwen2, qwen3, mistral, smollm3, olmo3, gemma3, qwen3_moe, mixtral) or peft.method=none"
        )
    if str(cfg.precision.float8) != "none":
        raise ConfigError(
            f"precision.float8={cfg.precision.float8} with peft.method={method}: the frozen base is not "
            "trained in float8; set precision.float8=none"
        )
    if method == "qlora" and str(cfg.precision.param_dtype) not in QLORA_DTYPES:
        raise ConfigError(
            f"peft.method=qlora with precision.param_dtype={cfg.precision.param_dtype}: the NF4 base "
            f"dequantizes to {' or '.join(QLORA_DTYPES)}; set precision=bf16"
        )
    check_target_experts(cfg)
    skipped = check_targets(cfg)
    if skipped and not bool(peft.target_experts):
        notes.append(
            f"peft.targets (the default): this model's MLP is routed experts, which take no adapters unless "
            f"peft.target_experts=true: {', '.join(skipped)} skipped, the attention's linears adapted"
        )
    if str(m.init_from) == "random":
        notes.append(f"peft.method={method} on a randomly initialised base (model.init_from=random)")


def check_target_experts(cfg: JobConfig) -> None:
    """peft.target_experts: a model with routed experts, no dropout (PEFT's `target_parameters` adapters
    have none: it cannot be factored out of a merged weight), and experts whole or split by expert
    parallel, not by tensor parallel's width split (check_target_experts_layout)."""
    if not bool(cfg.peft.target_experts):
        return
    from dtlaunch.models.registry import routed_experts

    m = cfg.model
    if not routed_experts(m):
        raise ConfigError(
            f"peft.target_experts=true: model.arch={m.arch} has no routed experts: set peft.target_experts=false"
        )
    if float(cfg.peft.dropout) > 0:
        raise ConfigError(
            f"peft.dropout={cfg.peft.dropout} with peft.target_experts=true: the experts' adapters are merged into "
            "their weights (as PEFT's target_parameters), which leaves no input to drop: set peft.dropout=0"
        )


def check_target_experts_layout(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    tp = d.layout.tp
    if bool(cfg.peft.target_experts) and tp > 1:
        raise ConfigError(
            f"peft.target_experts=true with strategy.tp={tp}: the experts' adapters are not split over tensor-"
            "parallel ranks yet: set strategy.tp=1 (FSDP or expert parallel) or peft.target_experts=false"
        )


def check_targets(cfg: JobConfig) -> list[str]:
    """Every name in peft.targets matches a linear of this model (the error lists the valid ones). Returns
    the default's names that are routed experts here (skipped: dtlaunch.models.lora.select_targets)."""
    from dtlaunch.config.schema import LORA_DEFAULT_TARGETS
    from dtlaunch.models.lora import expert_names, select_targets
    from dtlaunch.models.registry import meta_model, model_spec

    spec = model_spec(cfg.model)
    model = meta_model(cfg.model)
    targets = list(cfg.peft.targets)
    chosen = select_targets(model, spec, targets, str(cfg.model.arch))
    if tuple(targets) != LORA_DEFAULT_TARGETS:
        return []
    adapted = {hf.rsplit(".", 1)[-1] for hf in chosen.values()}
    mlp = ("gate_proj", "up_proj", "down_proj")
    return [t for t in targets if t in mlp and t not in adapted] if expert_names(model, spec) else []
