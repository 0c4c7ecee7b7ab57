"""The Gated DeltaNet hybrids' rules on their model section and layout (qwen3_next, qwen3_5, qwen3_5_moe):
the dense or MoE decoder's, one kind per block, key heads that divide the value heads, context parallel as
Ulysses only (cp dividing each tensor-parallel rank's key heads), and the layouts their Gated DeltaNet blocks
have no sharding for yet (float8 or LoRA on in_proj_qkv under tensor parallel; a GRPO rollout under sequence
parallel). Packed documents (data.document_mask) are taken: each
document's convolution and state start from zero (gated_deltanet.py). Each message names the family
(model.arch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError
from dtlaunch.models.dense.check import check as dense_check
from dtlaunch.models.moe.check import check as moe_check

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig

KINDS = ("linear_attention", "full_attention")


def check(cfg: JobConfig) -> None:
    """The MoE hybrids (qwen3_next, qwen3_5_moe)."""
    moe_check(cfg)
    check_linear_blocks(cfg)


def check_dense(cfg: JobConfig) -> None:
    """The dense hybrid (qwen3_5)."""
    dense_check(cfg)
    check_linear_blocks(cfg)


def check_linear_blocks(cfg: JobConfig) -> None:
    m = cfg.model
    arch = f"model.arch={m.arch}"
    kinds = list(m.layer_types or ())
    if kinds and (len(kinds) != int(m.n_layers) or any(k not in KINDS for k in kinds)):
        raise ConfigError(
            f"model.layer_types={kinds}: give one of {', '.join(KINDS)} per block ({int(m.n_layers)} entries), "
            f"or [] for {arch}'s default (full attention every fourth block)"
        )
    nk, nv = int(m.linear_num_key_heads), int(m.linear_num_value_heads)
    if nv % nk:
        raise ConfigError(
            f"model.linear_num_value_heads={nv} is not a multiple of model.linear_num_key_heads={nk}: "
            f"each key head serves a whole group of value heads"
        )
    if bool(cfg.objective.generation_compile):
        raise ConfigError(
            f"objective.generation_compile=true: {arch}'s linear blocks decode from a recurrent "
            "state that the compiled static-cache step does not hold yet: set objective.generation_compile=false"
        )


def check_layout(cfg: JobConfig, d: Decisions) -> None:
    """On the resolved layout (strategy=tp's tp=-1 means every rank): CP as Ulysses only; under TP
    (tp_plan.py) no float8 linears, no LoRA on Qwen3.5's in_proj_qkv (gathered, computed in slices; also
    through all-linear), and no GRPO rollout under sequence parallel (its decode steps' fillers)."""
    arch = f"model.arch={cfg.model.arch}"
    tp = int(d.layout.tp)
    if int(d.layout.cp) > 1:
        check_context_parallel(cfg, int(d.layout.cp), tp)
    if tp > 1 and cfg.precision.float8 != "none":
        raise ConfigError(
            f"precision.float8={cfg.precision.float8} with strategy.tp={tp}: {arch}'s Gated DeltaNet blocks "
            "split by tensor parallel have no float8 styles yet: set precision.float8=none or strategy.tp=1"
        )
    if int(d.decode_positions_multiple) > 1 and cfg.objective.name == "grpo":
        raise ConfigError(
            f"strategy.sequence_parallel=true with objective=grpo (strategy.tp={tp}): {arch}'s rollout would feed "
            "each decode step's filler copies into its recurrent state, which cannot drop them: set "
            "strategy.sequence_parallel=false"
        )
    peft = getattr(cfg, "peft", None)
    if tp > 1 and peft is not None and str(peft.method) != "none":
        from dtlaunch.models.registry import model_spec

        targets = [str(t) for t in peft.targets]
        split = "in_proj_qkv" in model_spec(cfg.model).block_linears(cfg.model)
        named = next((t for t in ("in_proj_qkv", "all-linear") if t in targets), None)
        if split and named is not None:
            raise ConfigError(
                f"peft.targets names {named} with strategy.tp={tp}: {arch}'s in_proj_qkv is gathered whole on every "
                "tensor-parallel rank and computed in per-head slices, which LoRA has no style for: name the "
                "linears without it, or set strategy.tp=1"
            )


def cp_divides_key_heads(m: Any, cp: int, tp: int) -> bool:
    """The linear blocks' rule under context parallel (Ulysses): cp divides each tensor-parallel rank's key heads
    (check_context_parallel refuses the rest; the plan search offers only these: registry `ulysses_degree_ok`)."""
    return (int(m.linear_num_key_heads) // tp) % cp == 0


def check_context_parallel(cfg: JobConfig, cp: int, tp: int) -> None:
    """strategy.cp > 1: the linear blocks run their recurrence over the whole sequence in order, which Ulysses
    gives them (key heads / cp of them per rank, their value heads with them: gated_deltanet.py) and ring
    attention does not; so cp must divide each tensor-parallel rank's key heads. The gated full attention
    blocks are the dense attention under Ulysses (strategy.check_ulysses: model.n_heads)."""
    arch = f"model.arch={cfg.model.arch}"
    style = str(cfg.strategy.cp_style)
    if style != "ulysses":
        raise ConfigError(
            f"strategy.cp_style={style} with strategy.cp={cp}: {arch}'s Gated DeltaNet blocks need the whole "
            "sequence in order, which only Ulysses gives them: set strategy.cp_style=ulysses"
        )
    nk = int(cfg.model.linear_num_key_heads)
    if not cp_divides_key_heads(cfg.model, cp, tp):
        per_rank = f" ({nk // tp} per tensor-parallel rank)" if tp > 1 else ""
        raise ConfigError(
            f"strategy.cp={cp} does not divide model.linear_num_key_heads={nk}{per_rank}: {arch}'s Gated DeltaNet "
            f"blocks give each context-parallel rank whole key heads and their value heads: use a cp that divides "
            f"{nk // tp}"
        )
