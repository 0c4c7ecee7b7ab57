"""Rules of the `objective` section (preference tuning), run by `validate` before any worker starts.

Ranges (beta, label_smoothing, sft_weight, gamma) are in config/ranges.py. Here: the pairs that do not go
together. Every layout runs every objective (under pipeline parallel: dtlaunch.train.objectives.pipeline).
"""

from __future__ import annotations

import os
from typing import Any

from dtlaunch.config.rules.grpo import check_grpo
from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError


def check_objective(cfg: Any, notes: list[str]) -> None:
    o, d = cfg.objective, cfg.data
    name = str(o.name)
    if str(d.format) == "prompt" and name != "grpo":
        raise ConfigError(
            f"data.format=prompt holds prompts without completions, which objective={name} cannot train on: use "
            f"objective=grpo (completions generated and scored by objective.rewards)"
        )
    if name == "grpo":
        check_grpo(cfg, notes)
        return
    if list(o.tools):
        raise ConfigError(
            f"objective.tools are called by the model while objective=grpo generates, not with objective={name}: "
            f"drop objective.tools"
        )
    if name == "sft":
        if str(d.format) == "preference":
            raise ConfigError(
                "data.format=preference holds pairs, which objective=sft cannot train on: "
                "use objective=dpo (or orpo, simpo), or another data.format"
            )
        return
    # data.kind=synthetic draws random pairs (benchmarks, plans: dtlaunch.data.preference.SyntheticPairs).
    if str(d.format) != "preference" and str(d.kind) != "synthetic":
        raise ConfigError(
            f"objective={name} trains on preference pairs, not data.format={d.format}: set data.format=preference "
            f"(with data.prompt_field, data.chosen_field, data.rejected_field)"
        )
    if float(o.beta) <= 0:
        raise ConfigError(f"objective.beta={o.beta} must be > 0 for objective={name}: e.g. objective.beta=0.1")
    if float(o.label_smoothing) > 0 and not (name == "dpo" and str(o.loss) == "robust"):
        raise ConfigError(
            f"objective.label_smoothing={o.label_smoothing} is used by objective.loss=robust only (TRL >= 0.29 "
            f"ignores it for sigmoid): set objective.loss=robust or objective.label_smoothing=0"
        )
    if name != "dpo":
        if str(o.reference) != "base" or bool(o.precompute_reference):
            raise ConfigError(
                f"objective={name} uses no reference model: drop objective.reference / "
                f"objective.precompute_reference (or use objective=dpo)"
            )
        if float(o.sft_weight) > 0:
            raise ConfigError(
                f"objective.sft_weight={o.sft_weight} is DPO's NLL term (ORPO has its own): set objective.sft_weight=0"
            )
        return
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


def check_reference(ref: str, model: Any) -> None:
    """objective.reference: base, hf:DIR (a Hugging Face model directory) or a dtlaunch run directory / one
    of its checkpoints (dtlaunch.config.reference_run)."""
    if ref == "base":
        return
    name = hf_name(ref)
    if name is None:
        from dtlaunch.config.reference_run import reference_checkpoint

        reference_checkpoint(ref, model)
        return
    path = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"objective.reference='{ref}': '{path}' holds no config.json: point it at a Hugging Face model "
            f"directory (e.g. one written by `dtlaunch ckpt export --format hf`)"
        )
