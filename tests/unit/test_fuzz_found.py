"""Wrong endings the hypothesis fuzz suite (tests/fuzz) found, kept as plain cases: each was an internal
error (exit 1) or several lines on stderr, and is now exit 2 with one line."""

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
    assert "Traceback" not in err and len(lines) == 1, err
    return int(exc.value.code or 0), lines[0]


def test_an_interpolation_in_an_optional_sections_field_is_type_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["validate", "+model.rope_scaling.factor=7.5", "model.rope_scaling.factor='${oc.env:HOME}'"]
    code, line = cli(argv, monkeypatch, capsys)
    assert code == 2 and "wrong type for 'model.rope_scaling.factor'" in line, line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "-m"], "dtlaunch: error: No such option: -m (see '"),
        (["generate"], "dtlaunch: error: Missing argument 'source'."),
        (["trian"], "dtlaunch: error: No such command 'trian'."),
    ],
)
def test_usage_errors_are_one_line(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(argv, monkeypatch, capsys)
    assert code == 2 and line.startswith(expected), line


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("a: &x [*x]\n", "line 3, column 4: an alias (*name) refers to a node containing it"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "is nested too deeply for a config"),
    ],
    ids=["recursive_alias", "deep_nesting"],
)
def test_recipes_that_recurse_are_refused(
    body: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("# @package _global_\n\n" + body)
    code, line = cli(["validate", f"recipe={f}"], monkeypatch, capsys)
    assert code == 2 and line.startswith(f"dtlaunch: error: recipe file '{f}'") and expected in line, line


def test_a_newline_inside_a_name_from_a_file_stays_on_the_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A safetensors header whose shape holds a string with a newline: the refusal shows it escaped."""
    import json
    import struct

    f = tmp_path / "adapter_model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": ["a\ntouch PWNED"], "data_offsets": [0, 0]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header)
    from dtlaunch.errors import InputError
    from dtlaunch.inputs.safetensors_header import read_header

    with pytest.raises(InputError) as exc:
        read_header(f, "restore it")
    assert "\n" not in str(exc.value) and '["a\\ntouch PWNED"]' in str(exc.value)
    # And whatever a message echoes, the CLI prints one line.
    code, line = cli(["validate", "recipe=/nonexistent/a\nb.yaml"], monkeypatch, capsys)
    assert code == 2 and "a\\nb.yaml" in line, line
