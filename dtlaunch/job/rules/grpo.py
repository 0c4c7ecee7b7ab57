"""Rules of objective=grpo (online RL), run by `validate` before any worker starts.

Ranges (num_generations >= 2, epsilon, temperature, top_p, ...) are in job/ranges.py. Here: the pairs
that do not go together. What needs the data (each reward function called once on a sample, prompts that
leave no room for the completion) is checked when the launcher reads the prompts (dtlaunch.inputs.rewards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.schema import JobConfig


def grpo_data_problem(cfg: JobConfig) -> str:
    """Why the job cannot train GRPO on its data, or "": its completions are generated from prompts, which
    only data.format=prompt records hold. The config rules let data.kind=synthetic through (the plan of a
    recipe before its prompts are named); the commands that check a job to run it (validate, train, submit,
    dry run or not) and the launcher's data preparation refuse it with this."""
    d = cfg.data
    if cfg.objective.name != ObjectiveName.grpo or str(d.format) == "prompt":
        return ""
    return (
        f"objective=grpo trains on generated completions of prompts, and data.kind={d.kind} holds none: set "
        f"data.kind=jsonl (or parquet, hf) data.format=prompt data.path=<your prompts>"
    )


def check_grpo(cfg: JobConfig, notes: list[str]) -> None:
    o, d, t = cfg.objective, cfg.data, cfg.training
    # data.kind=synthetic: the plan of a recipe before its prompts are named (`dtlaunch plan`); a job to run
    # refuses it (grpo_data_problem).
    if str(d.format) != "prompt" and str(d.kind) != "synthetic":
        raise ConfigError(
            f"objective=grpo generates its completions from prompts, not data.format={d.format}: set "
            f"data.format=prompt (with data.prompt_field)"
        )
    if str(o.reference) != "base" or bool(o.precompute_reference):
        raise ConfigError(
            "objective=grpo's KL term (objective.beta > 0) uses the initial weights (base): drop "
            "objective.reference / objective.precompute_reference"
        )
    if int(t.seq_len) <= int(o.max_completion_length):
        raise ConfigError(
            f"objective.max_completion_length={o.max_completion_length} leaves no room for a prompt in "
            f"training.seq_len={t.seq_len}: raise training.seq_len or lower objective.max_completion_length"
        )
    weights = list(o.reward_weights)
    if weights and len(weights) != len(o.rewards):
        raise ConfigError(
            f"objective.reward_weights has {len(weights)} value(s) for {len(o.rewards)} objective.rewards: give "
            f"one weight per reward function (or none: 1 each)"
        )
    if not list(o.rewards) and not (str(o.environment) or dict(o.environments)):
        # With an environment, its get_reward may be the only reward (TRL): checked once it is imported
        # (dtlaunch.inputs.tools.check_environments).
        raise ConfigError(
            "objective.rewards is empty: name at least one reward function, e.g. objective.rewards=[accuracy]"
        )
    mu, every = int(o.num_iterations), int(cfg.checkpoint.every_steps)
    if bool(cfg.checkpoint.enabled) and every > 0 and every % mu:
        # A checkpoint inside a generation batch could not be resumed exactly: the batch's completions came
        # from the weights at its first step, which the checkpoint no longer holds.
        raise ConfigError(
            f"checkpoint.every_steps={every} is not a multiple of objective.num_iterations={mu}: a resume "
            f"would regenerate a generation batch from later weights; set checkpoint.every_steps to a "
            f"multiple of {mu}"
        )
    if int(t.eval_every) > 0:
        raise ConfigError(
            f"training.eval_every={t.eval_every}: validation is not computed for objective=grpo yet: set "
            f"training.eval_every=0"
        )
    if bool(o.importance_sampling_correction):
        lo, hi = float(o.importance_sampling_clip_min), float(o.importance_sampling_clip_max)
        if lo >= hi:
            raise ConfigError(
                f"objective.importance_sampling_clip_min={lo} is not below objective.importance_sampling_clip_max="
                f"{hi}: lower the minimum (0: none) or raise the maximum"
            )


def check_grpo_layout(cfg: JobConfig, d: Decisions, notes: list[str]) -> None:
    if cfg.objective.name != ObjectiveName.grpo:
        return
    problem = grpo_layout_problem(cfg, d)
    if problem:
        raise ConfigError(problem)
    mode = str(cfg.objective.generation_gather)
    if mode != "auto" and not d.generation_gather:
        raise ConfigError(
            f"objective.generation_gather={mode} chooses how FSDP ZeRO-3 holds the weights while generating, and "
            f"this job does not shard them that way (strategy.zero_stage={cfg.strategy.zero_stage} over "
            f"{d.layout.dp} data-parallel rank(s)): leave objective.generation_gather=auto"
        )


def grpo_layout_problem(cfg: JobConfig, d: Decisions) -> str:
    """Why objective=grpo cannot run on the decided layout ("" when it can); `validate` refuses it and `plan --search`
    skips it. The generation batch is whole groups: every prompt's G completions in the same optimizer step,
    on the same data-parallel rank (the group's mean and std are taken there)."""
    g, layout = int(cfg.objective.num_generations), d.layout
    if layout.pp > 1:
        return (
            f"objective=grpo does not generate under pipeline parallel (strategy.pp={layout.pp}): use "
            f"strategy.pp=1 (FSDP or TP for a model that does not fit one GPU)"
        )
    # Context parallel splits each forward's sequence over its ranks, which decoding one position at a
    # time against a KV cache does not (tensor parallel generates on its shards: infer.batch_generate).
    if layout.cp > 1:
        return (
            f"objective=grpo does not generate under strategy.cp={layout.cp} yet: use strategy.cp=1 "
            f"(FSDP, strategy=fsdp, or tensor parallel, strategy.tp, shards a model that does not fit one GPU)"
        )
    per_rank = d.global_batch // max(layout.dp, 1)
    if d.global_batch % g or per_rank % g:
        return (
            f"training.global_batch={d.global_batch} ({per_rank} completions per data-parallel rank) "
            f"is not a multiple of objective.num_generations={g}: set training.global_batch to a multiple of "
            f"{g * max(layout.dp, 1)}"
        )
    return ""
