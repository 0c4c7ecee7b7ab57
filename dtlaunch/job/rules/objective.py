"""Rules of the `objective` section (preference tuning), run by `validate` before any worker starts.

Ranges (beta, label_smoothing, sft_weight, gamma) are in job/ranges.py. Here: the pairs that do not go
together. Every layout runs every preference objective (under pipeline parallel: dtlaunch.train.objectives.pipeline)
but objective=kto (check_kto_layout) and grpo (rules/grpo.py); objective=reward's scalar head runs without tensor,
pipeline and context parallel (check_reward).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dtlaunch.config.layout import Layout
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError
from dtlaunch.job.rules.grpo import check_grpo

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def check_objective(cfg: JobConfig, notes: list[str]) -> None:
    o, d = cfg.objective, cfg.data
    name = str(o.name)
    if str(d.format) == "prompt" and name != "grpo":
        raise ConfigError(
            f"data.format=prompt holds prompts without completions, which objective={name} cannot train on: use "
            f"objective=grpo (completions generated and scored by objective.rewards)"
        )
    if str(d.margin_field) and name != "reward":
        raise ConfigError(
            f"data.margin_field={d.margin_field} holds objective=reward's per-pair margins: drop it (or use "
            f"objective=reward)"
        )
    if name == "grpo":
        check_grpo(cfg, notes)
        return
    if list(o.tools):
        raise ConfigError(
            f"objective.tools are called by the model while objective=grpo generates, not with objective={name}: "
            f"drop objective.tools"
        )
    if str(d.format) == "unpaired" and name != "kto":
        raise ConfigError(
            f"data.format=unpaired holds labelled single completions, which objective={name} cannot train on: "
            f"use objective=kto, or another data.format"
        )
    if name == "sft":
        if str(d.format) == "preference":
            raise ConfigError(
                "data.format=preference holds pairs, which objective=sft cannot train on: "
                "use objective=dpo (or orpo, simpo, reward), or another data.format"
            )
        return
    if name == "kto":
        check_kto(cfg)
    # data.kind=synthetic draws random pairs (benchmarks, plans: dtlaunch.data.preference.SyntheticPairs).
    elif str(d.format) != "preference" and str(d.kind) != "synthetic":
        raise ConfigError(
            f"objective={name} trains on preference pairs, not data.format={d.format}: set data.format=preference "
            f"(with data.prompt_field, data.chosen_field, data.rejected_field)"
        )
    if name == "reward":
        check_reward(cfg)
        return
    if o.center_rewards_coefficient is not None:
        raise ConfigError(
            f"objective.center_rewards_coefficient={o.center_rewards_coefficient} is objective=reward's term: "
            f"drop it (or use objective=reward)"
        )
    if float(o.beta) <= 0:
        raise ConfigError(f"objective.beta={o.beta} must be > 0 for objective={name}: e.g. objective.beta=0.1")
    if float(o.label_smoothing) > 0 and not (name == "dpo" and str(o.loss) == "robust"):
        raise ConfigError(
            f"objective.label_smoothing={o.label_smoothing} is used by objective.loss=robust only (TRL >= 0.29 "
            f"ignores it for sigmoid): set objective.loss=robust or objective.label_smoothing=0"
        )
    if name != "kto" and str(o.loss) in KTO_LOSSES:
        raise ConfigError(f"objective.loss={o.loss} is objective=kto's: use objective=kto, or objective.loss=sigmoid")
    if name not in ("dpo", "kto"):
        if str(o.reference) != "base" or bool(o.precompute_reference):
            raise ConfigError(
                f"objective={name} uses no reference model: drop objective.reference / "
                f"objective.precompute_reference (or use objective=dpo or kto)"
            )
        if float(o.sft_weight) > 0:
            raise ConfigError(
                f"objective.sft_weight={o.sft_weight} is DPO's NLL term (ORPO has its own): set objective.sft_weight=0"
            )
        return
    if name == "kto" and float(o.sft_weight) > 0:
        raise ConfigError(f"objective.sft_weight={o.sft_weight} is DPO's NLL term: set objective.sft_weight=0")
    check_reference(str(o.reference), cfg.model)
    if bool(o.precompute_reference) and str(d.kind) == "synthetic":
        raise ConfigError(
            "objective.precompute_reference=true writes beside the pairs' token cache, which data.kind=synthetic "
            "has none of: use data.kind=jsonl / parquet / hf with data.format=preference, or drop it"
        )
    if int(cfg.training.eval_every) > 0:
        raise ConfigError(
            f"training.eval_every={cfg.training.eval_every}: validation is not computed for objective={name} yet: "
            f"set training.eval_every=0"
        )


def check_reward(cfg: JobConfig) -> None:
    """objective=reward (dtlaunch.train.objectives.reward): its scalar head replaces the decoder's LM head,
    which the layouts that split the head or the rows (tensor, pipeline, context parallel) and transformers'
    own models (model.arch=hf_auto) do not know of; it holds no reference. Under LoRA / QLoRA the head trains
    in full beside the adapters (dtlaunch.models.lora's modules_to_save)."""
    o = cfg.objective
    if str(cfg.model.arch) == "hf_auto":
        raise ConfigError(
            "model.arch=hf_auto is not supported with objective=reward (the scalar head replaces a registry "
            "decoder's `output`): use a registry family (model=llama3_8b, qwen2_7b, ...)"
        )
    if str(o.reference) != "base" or bool(o.precompute_reference):
        raise ConfigError(
            "objective=reward uses no reference model: drop objective.reference / objective.precompute_reference"
        )
    if int(cfg.training.eval_every) > 0:
        raise ConfigError(
            f"training.eval_every={cfg.training.eval_every}: validation is not computed for objective=reward yet: "
            f"set training.eval_every=0"
        )


def check_reward_layout(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    """objective=reward runs on data parallel layouts only (DDP, ZeRO-1/2/3): see check_reward."""
    if cfg.objective.name != ObjectiveName.reward:
        return
    layout = d.layout
    for key, value in (("strategy.tp", layout.tp), ("strategy.pp", layout.pp), ("strategy.cp", layout.cp)):
        if int(value) > 1:
            raise ConfigError(
                f"{key}={value} is not supported with objective=reward (its scalar head is not split): set {key}=1 "
                f"and shard with FSDP (strategy.zero_stage) instead"
            )


def check_reference(ref: str, model: Any) -> None:
    """objective.reference: base, hf:DIR (a Hugging Face model directory) or a dtlaunch run directory / one
    of its checkpoints (dtlaunch.job.reference_run)."""
    if ref == "base":
        return
    name = hf_name(ref)
    if name is None:
        from dtlaunch.job.reference_run import reference_checkpoint

        reference_checkpoint(ref, model)
        return
    path = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"objective.reference='{ref}': '{path}' holds no config.json: point it at a Hugging Face model "
            f"directory (e.g. one written by `dtlaunch ckpt export --format hf`)"
        )


KTO_LOSSES = ("kto", "apo_zero_unpaired")


def check_kto(cfg: JobConfig) -> None:
    """objective=kto (dtlaunch.train.objectives.kto): its data, its losses and the layouts it runs on."""
    o, d = cfg.objective, cfg.data
    if str(d.format) != "unpaired" and str(d.kind) != "synthetic":
        raise ConfigError(
            f"objective=kto trains on unpaired completions, not data.format={d.format}: set data.format=unpaired "
            f"(with data.prompt_field, data.completion_field, data.label_field)"
        )
    if str(o.loss) not in KTO_LOSSES:
        raise ConfigError(f"objective.loss={o.loss} is not a KTO loss: set objective.loss=kto or apo_zero_unpaired")
    if str(d.val_path) or float(d.val_fraction) > 0:
        raise ConfigError(
            "data.val_path / data.val_fraction: validation is not computed for objective=kto yet: drop them"
        )


def kto_layout_problem(cfg: JobConfig, layout: Layout, micro_batch: int) -> str:
    """Why objective=kto cannot run on `layout` with `micro_batch` ("" when it can); `validate` refuses it
    and `plan --search` skips it."""
    if layout.pp > 1:
        return (
            f"strategy.pp={layout.pp}: objective=kto does not run under pipeline parallel yet (its KL estimate is "
            f"averaged over every rank each micro-step): set strategy.pp=1"
        )
    if str(cfg.objective.loss) == "kto" and micro_batch < 2:
        # TRL refuses it too: the KL row of a one-example batch is the example itself.
        return (
            f"training.micro_batch={micro_batch}: objective.loss=kto estimates its KL term from the other "
            f"examples of a micro-batch: set training.micro_batch >= 2 (or objective.loss=apo_zero_unpaired)"
        )
    return ""


def check_kto_layout(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    layout = d.layout
    if cfg.objective.name != ObjectiveName.kto:
        return
    problem = kto_layout_problem(cfg, layout, int(cfg.training.micro_batch))
    if problem:
        raise ConfigError(problem)
