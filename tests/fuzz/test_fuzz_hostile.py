"""Property-based fuzzing of every input dtlaunch reads (hypothesis, seeded): override sets from the
schema, Hugging Face directories, peft adapters, chat templates and records, recipes, token shards,
checkpoints and the manifests among them (the HF index, meta.json, COMPLETE.json with its checksums).
The invariants are fuzz_harness's: exit 0/2/3 only, one line on stderr, nothing executed, nothing the
user owns changed, nothing written outside the case's output directory.

CI runs 158 cases; DTLAUNCH_FUZZ_PROFILE=night runs 5,350 (see fuzz_harness for the night run's flags).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_harness import HOSTILE_TEXT, Case, Tally, check, fuzz, fuzz_settings
from fuzz_overrides import override_set
from fuzz_spoil import copy_and_spoil, spoil_bytes
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

# Small steps, one process, the token cache inside the case's output directory.
TRAIN_SMALL = ["training.seq_len=8", "training.micro_batch=1", "training.global_batch=1", "launch.nproc_per_node=1"]


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory for the cases; `train` stops where the workers would start."""
    import dtlaunch.launch.local as local

    monkeypatch.setattr(local, "launch_local", lambda *a, **k: None)
    monkeypatch.setenv("DTLAUNCH_PROGRESS", "plain")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    repo = Path(__file__).resolve().parents[2]
    listing = _listing(repo)
    yield tmp_path
    assert _listing(repo) == listing


def _listing(repo: Path) -> list[str]:
    # hypothesis keeps its own cache directory in the working directory pytest started in.
    return sorted(n for n in os.listdir(repo) if n != ".hypothesis")


def _case_dirs(scratch: Path) -> tuple[Path, Path, Path]:
    """A fresh (root, inputs, outputs) for one case, under the scratch directory."""
    root = Path(tempfile.mkdtemp(dir=scratch, prefix="case"))
    (root / "out").mkdir()
    return root, root / "in", root / "out"


def _run_case(scratch: Path, tally: Tally, case: Case, root: Path) -> None:
    try:
        check(case, scratch, tally)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_fuzz_overrides(scratch: Path) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(40, 700)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            inp.mkdir()
            command = data.draw(st.sampled_from([["validate"]] * 3 + [["plan"], ["config"]]), label="command")
            argv = [*command, f"run.root={out / 'runs'}", *override_set(data)]
            _run_case(scratch, tally, Case(argv, [inp, scratch / "cwd"], out, "overrides"), root)

        one()

    fuzz("overrides", body)


HF_FILES = ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]
SHARDED_FILES = [
    "config.json",
    "model.safetensors.index.json",
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_fuzz_hf_directories(scratch: Path, fuzz_inputs: dict[str, Path]) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(25, 1100)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            sharded = data.draw(st.booleans(), label="sharded?")
            src = fuzz_inputs["hf_sharded" if sharded else "hf"]
            files = [f for f in (SHARDED_FILES if sharded else HF_FILES) if (src / f).is_file()]
            note = copy_and_spoil(data, src, inp / "model", files)
            d = inp / "model"
            argv = data.draw(
                st.sampled_from(
                    [
                        ["validate", f"model.init_from=hf:{d}"],
                        ["plan", f"model.init_from=hf:{d}"],
                        ["train", f"model.init_from=hf:{d}", f"run.dir={out / 'run'}", *TRAIN_SMALL],
                        ["generate", f"hf:{d}", "--prompt", "w1 w2", "--max-new-tokens", "2"],
                    ]
                ),
                label="command",
            )
            _run_case(scratch, tally, Case(argv, [inp], out, f"hf: {note}"), root)

        one()

    fuzz("hf directories", body)


def test_fuzz_adapters(scratch: Path, fuzz_inputs: dict[str, Path]) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(20, 1000)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            note = copy_and_spoil(
                data, fuzz_inputs["adapter"], inp / "adapter", ["adapter_config.json", "adapter_model.safetensors"]
            )
            argv = ["generate", f"hf:{fuzz_inputs['hf']}", "--adapter", str(inp / "adapter"), "--prompt", "w1 w2"]
            _run_case(scratch, tally, Case([*argv, "--max-new-tokens", "2"], [inp], out, f"adapter: {note}"), root)

        one()

    fuzz("adapters", body)


# Pieces of chat templates: well-formed ones, sandbox escapes, runaway ranges, runtime errors, syntax
# breakers. (No piece multiplies a string by a huge number or nests two maximal ranges: a template that
# asks for gigabytes or hours is a resource limit, not an input error, and not fuzzed here.)
TEMPLATE_PIECES = [
    "{% for m in messages %}",
    "{% endfor %}",
    "{{ m['content'] }}",
    "{{ m.role }} ",
    "{% if add_generation_prompt %}A:{% endif %}",
    "{% if m.role == 'user' %}U{% elif m.role == 'assistant' %}B{% else %}{{ raise_exception('role') }}{% endif %}",
    "{{ bos_token }}",
    "{{ messages | length }}",
    "{{ raise_exception('refused') }}",
    "{{ m.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{% set ns = namespace(_x=1) %}",
    "{{ range(10**12) | list }}",
    "{% for i in range(99999) %}{% endfor %}",
    "{{ 1 / 0 }}",
    "{{ m.content.upper() }}",
    "{{ x.y.z() }}",
    "{{ messages[99].content }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% include 'other.jinja' %}",
    "{% extends 'base.jinja' %}",
    "{{ strftime_now('%Y') }}",
    "{% generation %}{{ m['content'] }}{% endgeneration %}",
    "{{ m['content'] | tojson }}",
    "{{ '%d' % 'x' }}",
    "{%",
    "}}",
    "{% endif %}",
    "{{",
    "{# unclosed",
    "{% break %}",
    "\n",
    "é😀",
    *HOSTILE_TEXT[:6],
]
RECORD_LINES = [
    '{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}',
    '{"messages": []}',
    '{"messages": "w1"}',
    '{"messages": [{"role": "robot", "content": "w1"}]}',
    '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": null}]}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]}',
    '{"messages": [{"role": "user"}]}',
    '{"messages": [["user", "w1"]]}',
    '{"text": "w1"}',
    "[1, 2]",
    "null",
    '{"messages": [{"role": "user", "content": NaN}]}',
    '{"messages": ' + "[" * 5000 + "]" * 5000 + "}",
    "not json",
    '{"messages": [{"role": "user", "content": "w1"',
    "\ufeff{}",
]


def test_fuzz_chat_templates_and_records(scratch: Path, fuzz_inputs: dict[str, Path]) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(15, 250)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            shutil.copytree(fuzz_inputs["chat"], inp)
            if data.draw(st.booleans(), label="spoil template?"):
                pieces = data.draw(st.lists(st.sampled_from(TEMPLATE_PIECES), min_size=1, max_size=6), label="tpl")
                (inp / "template.jinja").write_text("".join(pieces))
            if data.draw(st.booleans(), label="spoil records?"):
                lines = data.draw(st.lists(st.sampled_from(RECORD_LINES), min_size=1, max_size=5), label="records")
                good = (inp / "chat.jsonl").read_text().splitlines()
                at = data.draw(st.integers(0, len(good)), label="at")
                (inp / "chat.jsonl").write_text("\n".join(good[:at] + lines + good[at:]) + "\n")
            if data.draw(st.integers(0, 4), label="bytes?") == 0:
                spoil_bytes(data, inp / data.draw(st.sampled_from(["template.jinja", "chat.jsonl"]), label="file"))
            job = [
                "data.kind=jsonl",
                f"data.path={inp / 'chat.jsonl'}",
                f"data.tokenizer={inp / 'tokenizer.json'}",
                "model.vocab_size=256",
                "data.format=chat",
                f"data.chat_template={inp / 'template.jinja'}",
                f"data.cache_dir={out / 'cache'}",
            ]
            command = data.draw(st.sampled_from(["validate", "train"]), label="command")
            extra = [f"run.dir={out / 'run'}", *TRAIN_SMALL] if command == "train" else []
            _run_case(scratch, tally, Case([command, *job, *extra], [inp], out, "chat"), root)

        one()

    fuzz("chat templates and records", body)


GOOD_RECIPE = """# @package _global_
defaults:
  - override /model: tiny
  - override /strategy: ddp
training:
  micro_batch: 2
  steps: 4
optim:
  lr: 0.001
"""
RECIPE_EDITS = [
    lambda t: t.replace("  ", "\t", 1),
    lambda t: t + "x: [1, 2\n",
    lambda t: t + "training:\n  steps: 9\n",
    lambda t: t.replace("steps: 4", "steps: 4\n  steps: 5"),
    lambda t: "",
    lambda t: "- a\n- b\n",
    lambda t: t + "training: null\n",
    lambda t: t.replace("# @package _global_\n", ""),
    lambda t: t.replace(":", "", 1),
    lambda t: t + "model: {dim: -3}\n",
    lambda t: t + "optim:\n  lr: .nan\n",
    lambda t: t + "run:\n  name: '$(touch PWNED)'\n",
    lambda t: t + "defaults: 3\n",
    lambda t: t + "a: &x [*x]\n",
    lambda t: t + "b: !!python/object/apply:os.system ['touch PWNED']\n",
    lambda t: t + "c: ${oc.env:HOME}\n",
    lambda t: t.replace("tiny", "../../etc"),
]


def test_fuzz_recipes(scratch: Path) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(25, 1200)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            inp.mkdir()
            text = GOOD_RECIPE
            for i in data.draw(st.lists(st.integers(0, len(RECIPE_EDITS) - 1), max_size=3), label="edits"):
                text = RECIPE_EDITS[i](text)
            f = inp / "r.yaml"
            f.write_text(text)
            if data.draw(st.booleans(), label="bytes?"):
                spoil_bytes(data, f)
            command = data.draw(st.sampled_from([["validate"], ["config"]]), label="command")
            _run_case(scratch, tally, Case([*command, f"recipe={f}", f"run.root={out}"], [inp], out, "recipe"), root)

        one()

    fuzz("recipes", body)


def test_fuzz_token_shards(scratch: Path, fuzz_inputs: dict[str, Path]) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(8, 100)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            files = sorted(p.name for p in fuzz_inputs["shards"].iterdir())
            note = copy_and_spoil(data, fuzz_inputs["shards"], inp / "shards", files)
            argv = ["train", "recipe=tiny_ddp", "data=tokens", f"data.path={inp / 'shards'}", "model.vocab_size=260"]
            argv += ["training.seq_len=16", f"run.dir={out / 'run'}"]
            _run_case(scratch, tally, Case(argv, [inp], out, f"shards: {note}"), root)

        one()

    fuzz("token shards", body)


def test_fuzz_checkpoints(scratch: Path, fuzz_inputs: dict[str, Path]) -> None:
    def body(tally: Tally) -> None:
        @fuzz_settings(25, 1000)
        @given(st.data())
        def one(data: st.DataObject) -> None:
            root, inp, out = _case_dirs(scratch)
            shutil.copytree(fuzz_inputs["run"], inp / "run")
            run = inp / "run"
            steps = sorted((run / "checkpoints").iterdir())
            step = data.draw(st.sampled_from(steps), label="step")
            files = sorted(p.name for p in step.iterdir() if p.is_file())
            note = ""
            for _ in range(data.draw(st.integers(1, 2), label="spoils")):
                present = [f for f in files if (step / f).is_file()]
                if present:
                    from fuzz_spoil import spoil_file

                    note += spoil_file(data, step / data.draw(st.sampled_from(present), label="file")) + "; "
            if data.draw(st.integers(0, 5), label="rmdir?") == 0:
                shutil.rmtree(step)
                note += f"removed {step.name}"
            target = data.draw(st.sampled_from([run, step]), label="target")
            argv = data.draw(
                st.sampled_from(
                    [
                        ["ckpt", "ls", str(run)],
                        ["ckpt", "verify", str(target)],
                        ["ckpt", "inspect", str(target), "--tensors"],
                        ["ckpt", "export", str(target), "--format", "torch", "--out", str(out / "e")],
                        ["ckpt", "export", str(target), "--format", "hf", "--out", str(out / "e")],
                        ["ckpt", "export", str(target), "--format", "peft", "--out", str(out / "e")],
                        ["generate", str(target), "--prompt", "hello", "--max-new-tokens", "2"],
                        ["status", str(run)],
                        [
                            "train",
                            "model=tiny",
                            "model.n_layers=1",
                            "strategy.dp_shard=1",
                            f"checkpoint.load_path={step}",
                            f"run.dir={out / 'run'}",
                            *TRAIN_SMALL,
                        ],
                    ]
                ),
                label="command",
            )
            _run_case(scratch, tally, Case(argv, [inp], out, f"checkpoint: {note}"), root)

        one()

    fuzz("checkpoints", body)
