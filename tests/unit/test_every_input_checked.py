"""Issue #47 defect 2: `validate`, `train --dry-run`, `submit --dry-run` and `train` refuse the same broken
input, each with exit 2 and one line on stderr naming its key, and `train` before it prints the plan.

The inputs come from the schema: every string field of the job (each section, and every model family's
fields) is either a file, directory or function of the user's, with a broken value in BROKEN, or a plain
value listed in VALUES. A new string field fails test_every_string_field_is_classified until it is put in
one or the other, and one put in BROKEN fails test_all_four_commands_refuse until every command checks it
(dtlaunch.launch.job_inputs.check_job_inputs, the one check load_job runs for all of them).

Runs the console entry point in-process (tests/cli_in_process.py): no subprocess, no worker.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, Callable

import pytest

# String fields that name no file, directory or function of the user's to read: names, choices, patterns,
# shell lines and settings handed on to other tools, and paths dtlaunch writes (outputs, not inputs).
VALUES = {
    "recipe",  # informational, set by composition
    "model.name",
    "model.arch",  # a registry name, refused at compose time when unknown
    "model.layer_types",  # sliding_attention / full_attention per block, checked by the olmo3 family
    "model.mlp_activation",  # gelu_tanh, fixed by the gemma3 family
    "strategy.pp_schedule",
    "peft.targets",  # module names
    "objective.format_regex",
    "objective.answer_field",
    "data.pattern",
    "data.text_field",
    "data.messages_field",
    "data.prompt_field",
    "data.completion_field",
    "data.chosen_field",
    "data.rejected_field",
    "data.label_field",
    "data.margin_field",
    "data.split",
    "data.subset",
    "data.revision",
    "data.val_split",
    "data.val_revision",
    "data.cache_dir",  # written
    "logging.wandb.mode",
    "logging.wandb.project",
    "logging.wandb.entity",
    "logging.mlflow.tracking_uri",
    "logging.mlflow.experiment",
    "checkpoint.dir",  # written
    "hardware.name",
    "launch.rdzv_endpoint",
    "launch.rdzv_id",
    "launch.backend",
    "cluster.kind",
    "cluster.partition",
    "cluster.account",
    "cluster.qos",
    "cluster.time",
    "cluster.eval_time",
    "cluster.mem",
    "cluster.sbatch_args",
    "cluster.setup",  # shell lines run on the cluster's nodes
    "cluster.k8s.namespace",
    "cluster.k8s.image",
    "cluster.k8s.pvc",
    "cluster.k8s.mount_path",
    "cluster.k8s.runtime",
    "cluster.k8s.service_account",
    "cluster.k8s.hf_token_secret",
    "cluster.k8s.cpu",
    "cluster.k8s.memory",
    "cluster.k8s.job_name",
    "cluster.k8s.context",
    "cluster.k8s.node_selector",
    "cluster.k8s.env",  # environment variables of the pods
    "cluster.sky.env",
    "cluster.sky.accelerator",
    "cluster.sky.cloud",
    "cluster.sky.bucket",
    "cluster.sky.store",
    "cluster.sky.mount_path",
    "cluster.sky.cluster_name",
    "cluster.sky.image_id",
    "run.name",
    "run.dir",  # written
    "run.root",  # written
    "debug.fail_mode",
}

# A tiny job, each case broken on top of it in one key.
TINY = ["training.steps=1", "training.seq_len=8", "training.micro_batch=2", "launch.nproc_per_node=1"]


def _grpo(d: Path, *extra: str) -> list[str]:
    from grpo_toy import toy_args

    data = ["data.kind=jsonl", f"data.path={d / 'prompts.jsonl'}", f"data.tokenizer={d / 'tokenizer.json'}"]
    return toy_args(data, *extra)


def _reward(body: str, name: str = "reward") -> Callable[[Path], list[str]]:
    """objective=grpo with objective.rewards naming `name` in a file of the user's whose function `reward`
    is `body`."""

    def args(d: Path) -> list[str]:
        f = d / f"r{len(list(d.glob('r*.py')))}.py"
        f.write_text(f"def reward(prompts, completions, completion_ids, **kw):\n    {body}\n")
        return _grpo(d, f"objective.rewards=[{f}:{name}]")

    return args


def _tool(source: str) -> Callable[[Path], list[str]]:
    """objective=grpo with objective.tools naming the function `tool` of a file of the user's."""

    def args(d: Path) -> list[str]:
        f = d / f"t{len(list(d.glob('t*.py')))}.py"
        f.write_text(source + "\n")
        return _grpo(d, f"objective.tools=[{f}:tool]")

    return args


def _environment(source: str, named: bool = False) -> Callable[[Path], list[str]]:
    """objective=grpo with objective.environment (or objective.environments.e) naming the class `Env` of a
    file of the user's."""

    def args(d: Path) -> list[str]:
        f = d / f"e{len(list(d.glob('e*.py')))}.py"
        f.write_text(source + "\n")
        return _grpo(d, f"+objective.environments.e={f}:Env" if named else f"objective.environment={f}:Env")

    return args


# Key -> {case: the overrides of a job whose `key` is broken (given a scratch directory)}.
BROKEN: dict[str, dict[str, Callable[[Path], list[str]]]] = {
    "model.init_from": {"missing": lambda d: [*TINY, f"model.init_from=hf:{d / 'no_model'}"]},
    "model._target_": {"missing": lambda d: [*TINY, "model._target_=no_such_module.build"]},
    "model.family_module": {
        "missing": lambda d: [*TINY, "model.family_module=no_such_family_module", "model.arch=llama"]
    },
    "data.path": {"missing": lambda d: [*TINY, "data.kind=jsonl", f"data.path={d / 'no.jsonl'}"]},
    "data.val_path": {"missing": lambda d: [*_grpo(d), f"data.val_path={d / 'no.jsonl'}"]},
    "data.tokenizer": {"missing": lambda d: [*TINY, f"data.tokenizer={d / 'no' / 'tokenizer.json'}"]},
    "data.chat_template": {
        "missing": lambda d: [
            *TINY,
            "data.kind=jsonl",
            "data.format=chat",
            f"data.path={d / 'chat.jsonl'}",
            f"data.tokenizer={d / 'tokenizer.json'}",
            "model.vocab_size=16",
            f"data.chat_template={d / 'no.jinja'}",
        ]
    },
    "checkpoint.load_path": {
        "missing": lambda d: [*TINY, f"checkpoint.load_path={d / 'no_ckpt'}"],
        "not_a_checkpoint": lambda d: [*TINY, f"checkpoint.load_path={d}"],  # a directory without one
    },
    "objective.reference": {
        "missing": lambda d: [
            *TINY,
            "objective=dpo",
            "data.kind=jsonl",
            "data.format=preference",
            f"data.path={d / 'pairs.jsonl'}",
            f"data.tokenizer={d / 'tokenizer.json'}",
            "model.vocab_size=16",
            f"objective.reference=hf:{d / 'no_model'}",
        ]
    },
    "objective.rewards": {
        "missing_file": lambda d: _grpo(d, f"objective.rewards=[{d / 'no_rewards.py'}:f]"),
        "missing_function": _reward("return [1.0] * len(completions)", name="no_such_function"),
        "raises": _reward("raise ValueError('boom')"),
        "nan": _reward("return [float('nan')] * len(completions)"),
        "wrong_count": _reward("return [1.0]"),
    },
    "objective.tools": {
        "no_schema": _tool("def tool(x):\n    return x"),  # no type hints, no docstring
    },
    "objective.environment": {
        "no_reset": _environment("class Env:\n    def look(self) -> str:\n        return ''"),
    },
    "objective.environments": {  # a method without type hints or docstring: no schema
        "no_schema": _environment(
            "class Env:\n    def reset(self, **kw):\n        pass\n\n    def act(self, x):\n        return x", True
        ),
    },
    # lm-eval's names are read from a cache file per install (dtlaunch.infer.task_names): the first command
    # on a machine indexes lm-eval's ~15k task YAMLs (~8 s), every later one reads ~15k names.
    "training.eval_tasks": {"unknown": lambda d: [*TINY, "training.eval_tasks=[arc_easyy]"]},
    "training.eval_include": {
        "missing": lambda d: [*TINY, "training.eval_tasks=[my_task]", f"training.eval_include={d / 'no_tasks'}"]
    },
    "debug.replay_completions": {"missing": lambda d: _grpo(d, f"debug.replay_completions={d / 'no_replay.jsonl'}")},
}
COMMANDS = {
    "validate": lambda run: ["validate"],
    "train --dry-run": lambda run: ["train", "--dry-run", f"run.dir={run}"],
    "submit --dry-run": lambda run: ["submit", "--dry-run", "cluster=slurm", f"run.dir={run}"],
    "train": lambda run: ["train", f"run.dir={run}"],
}


def _string_fields(cls: type, prefix: str = "") -> set[str]:
    """The dotted keys of every str / Optional[str] / list[str] / dict[str, ...] field under the schema class `cls`."""
    from dtlaunch.config.schema import section_type

    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], prefix + f.name
        section = section_type(hint)
        if section is not None:
            keys |= _string_fields(section, key + ".")
        elif str in (hint, *typing.get_args(hint)):  # str, Optional[str], list[str], dict[str, str]
            keys.add(key)
    return keys


def test_every_string_field_is_classified() -> None:
    from dtlaunch.job.model_schema import job_schema

    fields = _string_fields(job_schema())  # the model section: every registered family's fields
    unclassified = sorted(fields - VALUES - set(BROKEN))
    assert not unclassified, f"new string fields: add each to BROKEN (an input, with a check) or VALUES: {unclassified}"
    assert not (VALUES | set(BROKEN)) - fields, "fields listed here that the schema no longer has"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the jobs read: the toy GRPO prompts and tokenizer, a chat record, a preference pair."""
    from grpo_toy import write_tokenizer

    d = tmp_path_factory.mktemp("inputs")
    write_tokenizer(d / "tokenizer.json")
    prompts = [json.dumps({"prompt": f"{a} {b}", "answer": "7"}) for a in ("the", "a", "is", "copy") for b in "ab"]
    (d / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    chat = {"messages": [{"role": "user", "content": "the"}, {"role": "assistant", "content": "a"}]}
    (d / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    (d / "pairs.jsonl").write_text(json.dumps({"prompt": "the", "chosen": "a", "rejected": "is"}) + "\n")
    return d


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of `dtlaunch argv`, in this process."""
    from cli_in_process import run_cli_split

    return run_cli_split(argv)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import dtlaunch.launch.local as local

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("workers were launched")

    monkeypatch.setattr(local, "launch_local", refuse)


CASES = [(key, case) for key, cases in BROKEN.items() for case in cases]


@pytest.mark.parametrize("key, case", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_all_four_commands_refuse(key: str, case: str, scratch: Path, tmp_path: Path, no_launch: None) -> None:
    args = BROKEN[key][case](scratch)
    for name, command in COMMANDS.items():
        run = tmp_path / name.replace(" ", "_")
        code, err, out = _cli([*command(run), *args])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, f"{name} {key} ({case}): exit {code}\n{err[-1500:]}"
        named = f"{key}=" in lines[0] or f"{key}:" in lines[0]  # the key and its value, or the key's own message
        assert lines[0].startswith("dtlaunch: error: ") and named, f"{name}: {lines[0]}"
        if name.startswith("train"):  # refused before the plan: nothing printed but the phase it was in
            printed = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("[dtlaunch] ")]
            assert not printed, f"{name} printed before refusing:\n{out[-1500:]}"
        assert not run.exists(), f"{name} made its run directory"


def test_the_unbroken_jobs_pass_all_four(scratch: Path, tmp_path: Path, no_launch: None) -> None:
    """The checks refuse only what is broken: the GRPO base job with a good reward of the user's passes
    validate and both dry runs, and train refuses nothing before it launches."""
    args = _reward("return [float(len(c)) for c in completions]")(scratch)
    for name, command in COMMANDS.items():
        code, err, _ = _cli([*command(tmp_path / name.replace(" ", "_")), *args])
        if name == "train":
            assert code == 1 and "workers were launched" in err, err[-1500:]
        else:
            assert code == 0, f"{name}: exit {code}\n{err[-1500:]}"


# A job the config rules accept for its plan but no run can train: GRPO on data that holds no prompts (the
# shipped GRPO recipes before data.path names them). `plan` plans it; the four commands refuse it.
PLANNED_ONLY = [
    *TINY,
    "objective=grpo",
    "objective.max_completion_length=2",
    "objective.num_generations=2",
    "training.global_batch=2",
]


def test_grpo_without_prompts_is_planned_but_refused_to_run(tmp_path: Path, no_launch: None) -> None:
    code, err, out = _cli(["plan", *PLANNED_ONLY])
    assert code == 0 and "fits:" in out, err[-1500:]
    for name, command in COMMANDS.items():
        run = tmp_path / name.replace(" ", "_")
        code, err, _ = _cli([*command(run), *PLANNED_ONLY])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "data.kind=synthetic" in lines[0], f"{name}: exit {code}\n{err}"
        assert not run.exists(), f"{name} made its run directory"
