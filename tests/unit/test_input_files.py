"""Broken recipe files and unusable paths: one line naming the file (line and column where YAML gives
one) and the cause in full, exit 2; range rules on numeric fields at validate time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtlaunch.cli import run


def cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert len(lines) <= 1, err
    return int(exc.value.code or 0), (lines[0] if lines else "")


PKG = "# @package _global_\n"
RECIPES = [
    ("syntax", PKG + "training:\n  steps: [1, 2\n  seq_len: 3\n", ["line 4, column", "YAML syntax error", "flow"]),
    ("tab", PKG + "training:\n\tsteps: 3\n", ["line 3, column 1", "tab"]),
    ("duplicate", PKG + "training:\n  steps: 3\n  steps: 4\n", ["line 4, column 3", "duplicate key 'steps'", "line 3"]),
    ("duplicate_section", PKG + "model:\n  dim: 64\nmodel:\n  dim: 32\n", ["line 4", "duplicate key 'model'"]),
    ("empty", "", ["is empty", "@package _global_"]),
    ("comment_only", "# nothing\n", ["is empty"]),
    ("list", "- a\n- b\n", ["holds a list", "not a mapping"]),
    ("scalar", "hello\n", ["holds the single value 'hello'"]),
    ("null_section", PKG + "training: null\n", ["line 2, column 1", "section 'training' is empty (null)"]),
    ("no_package", "training:\n  steps: 3\n", ["lacks the line '# @package _global_'"]),
]


@pytest.mark.parametrize(("name", "text", "expected"), RECIPES, ids=[r[0] for r in RECIPES])
def test_recipe_file_errors_name_file_line_and_cause(
    name: str,
    text: str,
    expected: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    code, line = cli(["validate", f"recipe={f}"], monkeypatch, capsys)
    assert code == 2, line
    assert line.startswith(f"dtlaunch: error: recipe file '{f}'"), line
    for part in expected:
        assert part in line, line
    assert not line.endswith(":")


def test_compose_errors_are_never_cut_mid_sentence() -> None:
    from dtlaunch.job.compose import _first_line

    exc = ValueError("In 'recipe/x': ValidationError raised while composing config:\nthe cause\n    full_key: recipe")
    assert _first_line(exc) == "In 'recipe/x': ValidationError raised while composing config: the cause"


def test_os_errors_on_user_paths_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "in.txt"
    text.write_text("hello world\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    cases = [
        (["validate", f"recipe={tmp_path / ('x' * 300)}.yaml"], "File name too long"),
        (["data", "prepare", str(text), "--out", str(a_file)], "give a directory path"),
        (["data", "prepare", str(text), "--out", str(a_file / "sub")], "Not a directory"),
        (["validate", f"recipe={tmp_path}/"], "recipe"),
        (["ckpt", "ls", str(a_file / ("x" * 200))], ""),
    ]
    for argv, expected in cases:
        code, line = cli(argv, monkeypatch, capsys)
        assert code == 2, (argv, line)
        assert line.startswith("dtlaunch: error: ") and expected in line, line
    assert a_file.read_text() == "keep me"


RANGES = [
    ("optim.lr=nan", "optim.lr"),
    ("optim.lr=inf", "optim.lr"),
    ("optim.beta1=5", "optim.beta1"),
    ("optim.beta2=1.0", "optim.beta2"),
    ("optim.eps=0", "optim.eps"),
    ("model.ffn_dim=-5", "model.ffn_dim"),
    ("model.norm_eps=-1", "model.norm_eps"),
    ("model.rope_theta=nan", "model.rope_theta"),
    ("hardware.gpus_per_node=-1", "hardware.gpus_per_node"),
    ("hardware.peak_tflops_fp32=inf", "hardware.peak_tflops_fp32"),
    ("hardware.fragmentation=1.5", "hardware.fragmentation"),
    ("training.grad_clip=nan", "training.grad_clip"),
    ("strategy.tp=0", "strategy.tp"),
    ("strategy.dp_shard=-2", "strategy.dp_shard"),
    ("launch.threads_per_worker=-3", "launch.threads_per_worker"),
    ("debug.slow_save_s=-1", "debug.slow_save_s"),
    ("data.max_bytes=-1", "data.max_bytes"),
]


@pytest.mark.parametrize(("override", "key"), RANGES, ids=[r[0] for r in RANGES])
def test_range_rules_at_validate(
    override: str, key: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(["validate", override], monkeypatch, capsys)
    assert code == 2, line
    value = override.split("=", 1)[1]
    assert f"{key}=" in line and value.lower() in line.lower() and "set " in line, line


def test_every_numeric_field_has_a_range_rule() -> None:
    import dataclasses
    import typing

    from dtlaunch.job.model_schema import job_schema
    from dtlaunch.job.ranges import RANGES

    missing = []

    def walk(node: type, prefix: str) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            hint = hints[f.name]
            inner = next((a for a in (hint, *getattr(hint, "__args__", ())) if dataclasses.is_dataclass(a)), None)
            if inner is not None:
                walk(inner, f"{prefix}{f.name}.")
            elif (
                any(t in (int, float) for t in (hint, *getattr(hint, "__args__", ()))) and prefix + f.name not in RANGES
            ):
                missing.append(prefix + f.name)

    walk(job_schema(), "")  # the model section: every family's fields
    assert not missing, missing


def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks must stop the run before any worker starts."""
    import dtlaunch.launch.local as local

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("workers were launched")

    monkeypatch.setattr(local, "launch_local", refuse)


def _shards(path: Path, ids: list[int], vocab: int) -> None:
    import numpy as np

    from dtlaunch.data.shards import ShardWriter

    w = ShardWriter(path, np.uint16, 1000)
    w.add(np.array(ids, dtype=np.uint16))
    w.close({"vocab_size": vocab, "tokenizer": "byte"})


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([1, 2, 3] * 200 + [300] + [4] * 100, "token id 300 at position 600"),
        ([1, 2, 3] * 20, "one global batch needs"),  # prepare_run_data, before the scan
    ],
    ids=["id_above_vocab", "too_short"],
)
def test_data_checked_before_launch(
    ids: list[int],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_launch(monkeypatch)
    _shards(tmp_path / "shards", ids, 260)
    args = ["train", "recipe=tiny_ddp", "data=tokens", f"data.path={tmp_path / 'shards'}", "model.vocab_size=260"]
    code, line = cli([*args, "training.seq_len=16", f"run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 2 and expected in line and "data.path=" in line, line


def test_a_local_model_with_config_json_only_plans_and_is_refused_by_train(
    tmp_path: Path, tiny_hf_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planning and validating read config.json only (as for a hub name); train needs the weights and says so
    before it creates a run directory."""
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_hf_dirs["qwen2"] / "config.json", model)
    job = ["recipe=tiny_ddp", f"model.init_from=hf:{model}"]
    for command in ("validate", "plan"):
        assert cli([command, *job], monkeypatch, capsys)[0] == 0
    _no_launch(monkeypatch)
    code, err = cli(["train", *job, f"run.root={tmp_path / 'runs'}"], monkeypatch, capsys)
    assert code == 2 and "has no model.safetensors" in err, err
    assert not (tmp_path / "runs").exists()
