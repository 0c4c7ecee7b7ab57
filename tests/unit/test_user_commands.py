"""Everyday commands in-process, through the real console entry point: `recipes` (list, show, cp),
`status` of local runs, sweep and `hydra.*` argument errors. Bad input: one line, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtlaunch.cli import run


def run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    return int(exc.value.code or 0)


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtlaunch: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def recipe_rows() -> list[list[str]]:
    from dtlaunch.commands.recipes import recipe_rows

    return recipe_rows([])  # composes and plans every recipe: once for every width below


@pytest.mark.parametrize("columns", [60, 80])
def test_recipes_table_keeps_names_whole_and_fits(columns: int, recipe_rows) -> None:
    import io

    from rich.console import Console

    from dtlaunch.commands.recipes import recipes_table
    from dtlaunch.config.compose import list_recipes

    buf = io.StringIO()
    Console(file=buf, width=columns).print(recipes_table(recipe_rows, columns))
    out = buf.getvalue()
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= columns, out
    first_words = {ln.split()[0] for ln in lines if ln.strip()}
    for name in list_recipes():
        assert name in first_words, out
    # The status column is the analytic plan's verdict: llama8b_ddp needs ~202 GiB on an 80 GB GPU.
    row = next(ln for ln in lines if ln.startswith("llama8b_ddp "))
    assert "does" in row and "fits" not in row, out
    assert "fits" in next(ln for ln in lines if ln.startswith("llama8b_fsdp "))
    # No value is cut: every model name and hardware name appears whole.
    for word in ("llama3_405b", "(405.85B)", "h100_80gb", "a100_80gb", "fsdp_tp"):
        assert word in out, out


def test_recipes_show_and_cp(tmp_path: Path, monkeypatch, capsys) -> None:
    from dtlaunch.config.compose import list_recipes

    monkeypatch.chdir(tmp_path)
    assert run_cli(["recipes", "show", "tiny_ddp"], monkeypatch) == 0
    assert list_recipes()["tiny_ddp"].read_text() in capsys.readouterr().out
    assert run_cli(["recipes", "cp", "tiny_ddp", "mine"], monkeypatch) == 0
    assert "recipe=./mine.yaml" in capsys.readouterr().out
    assert (tmp_path / "mine.yaml").read_bytes() == list_recipes()["tiny_ddp"].read_bytes()
    # The copy is a recipe as it stands.
    assert run_cli(["validate", "recipe=./mine.yaml", "training.steps=3"], monkeypatch) == 0
    capsys.readouterr()
    # Onto an existing file: refused without --force, overwritten with it.
    (tmp_path / "mine.yaml").write_text("edited\n")
    assert run_cli(["recipes", "cp", "tiny_ddp", "mine.yaml"], monkeypatch) == 2
    assert "already exists" in one_error_line(capsys.readouterr().err)
    assert (tmp_path / "mine.yaml").read_text() == "edited\n"
    assert run_cli(["recipes", "cp", "tiny_ddp", "mine.yaml", "--force"], monkeypatch) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == list_recipes()["tiny_ddp"].read_bytes()
    # Default destination ./NAME.yaml; an unknown recipe is named with a suggestion.
    assert run_cli(["recipes", "cp", "tiny_fsdp"], monkeypatch) == 0
    assert (tmp_path / "tiny_fsdp.yaml").is_file()
    capsys.readouterr()
    assert run_cli(["recipes", "show", "tiny_fsdpp"], monkeypatch) == 2
    assert "did you mean 'tiny_fsdp'" in one_error_line(capsys.readouterr().err)
