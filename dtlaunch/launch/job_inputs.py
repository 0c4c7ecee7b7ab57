"""The files and functions a composed job names, checked before anything runs or is printed: the model
directory's tensors against its config.json, the tokenizer file, the chat template, the checkpoint to load,
the reward functions, the tools, the evaluation's tasks and their directory, a replay file.

`check_job_inputs` is the one check every command that reads a job runs (dtlaunch.commands.common.load_job:
validate, plan, train and submit, dry run or not), after composition (which refuses a model.family_module
it cannot import) and the config rules (dtlaunch.job.validate: a missing data.path, data.val_path,
data.tokenizer, checkpoint.load_path, objective.reference, model._target_), and before the plan: what
`train` would refuse, `validate` refuses too (tests/unit/test_every_input_checked.py holds every command
to it for every such field of the schema)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.inputs.chat_template import check_chat_template
from dtlaunch.inputs.hf_dir import check_tokenizer_json, weight_files
from dtlaunch.run.run_dir import tokenizer_file

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_job_inputs(cfg: JobConfig, to_run: bool = False) -> None:
    """`to_run`: the job is checked to be run (validate, train, submit; dry run or not), not only planned
    (plan, config, the recipes table): what only a run needs is refused too (GRPO's prompts)."""
    if to_run:
        from dtlaunch.job.rules.grpo import grpo_data_problem

        problem = grpo_data_problem(cfg)
        if problem:
            raise InputError(problem)
    check_model_weights(cfg)
    tok = str(cfg.data.tokenizer)
    if tok not in ("auto", "byte") and Path(tok).is_file():
        check_tokenizer_json(Path(tok))
    if str(cfg.data.format) == "chat" or (str(cfg.data.format) == "prompt" and str(cfg.data.chat_template)):
        check_job_chat_template(cfg)
    check_load_path(cfg)
    check_job_rewards(cfg)
    check_job_tools(cfg)
    check_eval_inputs(cfg)
    check_replay_completions(cfg)


def check_load_path(cfg: JobConfig) -> None:
    """checkpoint.load_path (a directory, said the config rules) holds a complete checkpoint: its markers,
    no tensor read; train verifies the contents and the model's shapes when it resumes (preflight.check_resume)."""
    load_path = str(cfg.checkpoint.load_path)
    if not load_path:
        return
    from dtlaunch.run.checkpoints import resolve_load_path

    try:
        resolve_load_path(Path(load_path))
    except ConfigError as exc:
        raise ConfigError(f"checkpoint.load_path: {exc}") from None


def check_job_rewards(cfg: JobConfig) -> None:
    """objective=grpo: every function of objective.rewards imported and called once on the first prompt
    record (dtlaunch.inputs.tools.check_rewards), the call the launcher makes before any worker starts.
    A hub dataset is not fetched to check a job: its functions are imported here and called on its first
    record when the launcher prepares the prompts (dtlaunch.data.prompts.prepare_prompts)."""
    if cfg.objective.name != ObjectiveName.grpo:
        return
    from dtlaunch.inputs.rewards import load_rewards
    from dtlaunch.inputs.tools import check_rewards

    d = cfg.data
    first = None
    if str(d.format) == "prompt" and str(d.kind) != "synthetic":
        from dtlaunch.hub.dataset import dataset_ref

        if dataset_ref(cfg, str(d.path), "data.path") is None:
            from dtlaunch.data.prompts import first_prompt_record

            first = first_prompt_record(str(d.kind), str(d.path), str(d.split), str(d.prompt_field))
    if first is None:  # no record to call them on here (none at all: prepare_prompts says how many it needs)
        load_rewards(cfg.objective)
        return
    check_rewards(cfg.objective, first[0], str(d.prompt_field), first[1])


def check_job_tools(cfg: JobConfig) -> None:
    """objective.tools: every tool imported and its JSON schema built (dtlaunch.inputs.tools.check_tools);
    objective.environment(s): the class imported, its `reset` callable, its methods' schemas built
    (check_environments). Whether the chat template can render and parse tool calls is checked with the
    prompts (dtlaunch.data.prompts.prepare_prompts), where the tokenizer is at hand."""
    o = cfg.objective
    if o.name != ObjectiveName.grpo or not (list(o.tools) or str(o.environment) or dict(o.environments)):
        return
    from dtlaunch.inputs.tools import check_environments, check_tools

    check_environments(o, check_tools(o))


def check_eval_inputs(cfg: JobConfig) -> None:
    """training.eval_tasks, evaluated after training: lm-eval installed, training.eval_include a directory,
    every task name known to it or to lm-eval (whose ~15k names are read from a cache file per install:
    dtlaunch.infer.task_names), and a chat template to apply where one is asked for. Whether lm-eval's model
    class imports and its hub datasets are reachable depends on where the evaluation runs: `train` checks
    that here, a submitted job on the cluster."""
    if not cfg.training.eval_tasks:
        return
    from dtlaunch.infer.harness import BYTE_NO_CHAT, TRAINING_KEYS, check_request, eval_request
    from dtlaunch.job.tokenizer_choice import effective_tokenizer

    include = str(cfg.training.eval_include)
    if include and not Path(include).expanduser().is_dir():
        raise InputError(f"training.eval_include='{include}': no such directory: give a directory of task YAML files")
    if cfg.training.eval_apply_chat_template and effective_tokenizer(cfg) == "byte":
        raise ConfigError(f"training.eval_apply_chat_template=true: this run is {BYTE_NO_CHAT}: set it to false")
    check_request(eval_request(cfg), *TRAINING_KEYS, datasets_here=False, build_manager=False)


def check_replay_completions(cfg: JobConfig) -> None:
    """debug.replay_completions, the JSONL of completions the rollout reads instead of sampling."""
    replay = str(cfg.debug.replay_completions)
    if replay and not Path(replay).expanduser().is_file():
        raise InputError(
            f"debug.replay_completions='{replay}': no such file: give the JSONL of recorded completions, or drop it"
        )


def check_model_weights(cfg: JobConfig, fetch: bool = False) -> None:
    """model.init_from=hf:DIR: every tensor present and of the shape config.json implies (headers only).

    Planning and validating read config.json only: a hub name is checked only with fetch=True (train,
    once it needs the weights, which fetches them), and so is a local directory that holds no weights
    (config.json alone is enough to plan); a local directory's weights, where it has some, are checked
    always (cheap, and a spoiled file is better found before a plan is trusted)."""
    from dtlaunch.convert.hf import HFWeights, hf_init_dir
    from dtlaunch.models.registry import model_spec

    if is_hub_model(cfg) and not fetch:
        return
    path = hf_init_dir(cfg.model)
    if path is None or not model_spec(cfg.model).hf_names:  # hf_auto: transformers reads its own names
        return
    if fetch or weight_files(Path(path)):
        HFWeights(path, cfg.model)


def check_training_weights(cfg: JobConfig, fetch: bool) -> None:
    """Before a job that trains (train, submit) creates anything: the weights it starts from are there. A
    hub model's are fetched and checked with fetch=True (`submit` checks its cache instead); a local
    hf:DIR holding config.json only, enough to plan, is refused here."""
    from dtlaunch.convert.hf import hf_init_dir

    if is_hub_model(cfg):
        if fetch:
            check_model_weights(cfg, fetch=True)
        return
    path = hf_init_dir(cfg.model)
    if path is not None and not weight_files(Path(path)):  # with weights: checked when the job was loaded
        check_model_weights(cfg, fetch=True)


def is_hub_model(cfg: JobConfig) -> bool:
    """model.init_from names a hub repository (hf:ORG/NAME), not a local directory."""
    from dtlaunch.hub.resolve import model_ref

    src = str(cfg.model.init_from)
    name = hf_name(src)
    return name is not None and model_ref(name) is not None


def check_job_chat_template(cfg: JobConfig) -> None:
    """data.chat_template (a built-in name or a Jinja file), else the tokenizer's own template."""
    from dtlaunch.data.chat_templates import chosen_chat_template

    spec = str(cfg.data.chat_template)
    if spec:
        template, where = chosen_chat_template(spec, Path())  # a set template reads no tokenizer
        check_chat_template(template, where, "fix the template file (data.chat_template)")
        return
    from dtlaunch.job.tokenizer_choice import effective_tokenizer

    tok_json = tokenizer_file(Path(effective_tokenizer(cfg)).expanduser())
    if tok_json.is_file():
        template, where = chosen_chat_template("", tok_json)
        if template:
            check_chat_template(template, where, "fix it, or set data.chat_template to a built-in name or a Jinja file")
