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


# `dtlaunch recipes` itself (the command, its console width, exit 0) runs as a documented command:
# tests/e2e/test_docs_commands.py::test_documented_command[README.md:40].
@pytest.fixture(scope="module")
def recipe_rows() -> list[list[str]]:
    from dtlaunch.commands.recipes import recipe_rows

    return recipe_rows([])  # composes and plans every recipe: once for every width below


@pytest.mark.parametrize("columns", [60, 80])
def test_recipes_table_keeps_names_whole_and_fits(columns: int, recipe_rows) -> None:
    import io

    from rich.console import Console

    from dtlaunch.commands.recipes import recipes_table
    from dtlaunch.job.compose import list_recipes

    buf = io.StringIO()
    Console(file=buf, width=columns).print(recipes_table(recipe_rows, columns))
    out = buf.getvalue()
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= columns, out
    first_words = {ln.split()[0] for ln in lines if ln.strip()}
    for name in list_recipes():
        assert name in first_words, out
    assert "invalid" not in out  # every shipped recipe composes and validates
    # The status column is the analytic plan's verdict: llama8b_ddp needs ~202 GiB on an 80 GB GPU.
    row = next(ln for ln in lines if ln.startswith("llama8b_ddp "))
    assert "does" in row and "fits" not in row, out
    assert "fits" in next(ln for ln in lines if ln.startswith("llama8b_fsdp "))
    # No value is cut: every model name and hardware name appears whole.
    for word in ("llama3_405b", "(405.85B)", "h100_80gb", "a100_80gb", "fsdp_tp"):
        assert word in out, out


def test_recipes_show_and_cp(tmp_path: Path, monkeypatch, capsys) -> None:
    from dtlaunch.job.compose import list_recipes

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


def test_sweep_expands_with_hydras_grammar() -> None:
    from dtlaunch.commands.sweep import expand_sweep

    points, swept = expand_sweep(["recipe=tiny_ddp", "optim.lr=1e-3,1e-2", "training.steps=range(2,5,2)"])
    assert swept == {"optim.lr", "training.steps"}
    # Cartesian product, the last key varying fastest (Hydra's basic sweeper order).
    assert [p[1:] for p in points] == [
        ["optim.lr=0.001", "training.steps=2"],
        ["optim.lr=0.001", "training.steps=4"],
        ["optim.lr=0.01", "training.steps=2"],
        ["optim.lr=0.01", "training.steps=4"],
    ]
    assert all(p[0] == "recipe=tiny_ddp" for p in points)
    points, swept = expand_sweep(["model=choice(tiny,small)", "+x=1"])
    assert points == [["model=tiny", "+x=1"], ["model=small", "+x=1"]] and swept == {"model"}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["training.steps=range(1,"], "cannot parse 'training.steps=range(1,'"),
        (["optim.lr=interval(0.1,1)"], "interval sweep is not supported"),
        (["recipe=tiny_ddp", "training.stepz=1,2"], "sweep point 0 (training.stepz=1): unknown key 'training.stepz'"),
        (["recipe=tiny_ddp", "hydra.sweep.dir=/tmp/x"], "use run.dir=DIR with -m"),
    ],
)
def test_bad_sweeps_are_one_line_exit_2(args, expected, tmp_path: Path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "sweep"
    assert run_cli(["train", "-m", *args, f"run.dir={run_dir}"], monkeypatch) == 2
    assert expected in one_error_line(capsys.readouterr().err)
    assert not run_dir.exists()  # refused before anything was created


def test_hydra_habits(monkeypatch, capsys) -> None:
    # `--cfg job` prints the composed config, as `dtlaunch config` does.
    assert run_cli(["train", "recipe=tiny_ddp", "training.steps=7", "--cfg", "job"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "zero_stage: 0" in out
    assert run_cli(["train", "recipe=tiny_ddp", "hydra.run.dir=/tmp/x"], monkeypatch) == 2
    assert "use run.dir=DIR" in one_error_line(capsys.readouterr().err)
    # A sweep value without -m says how to run it.
    assert run_cli(["validate", "recipe=tiny_ddp", "optim.lr=1e-3,1e-2"], monkeypatch) == 2
    assert "add -m (--multirun)" in one_error_line(capsys.readouterr().err)


def test_submit_sweep_is_one_job_array(tmp_path: Path, monkeypatch, capsys) -> None:
    import shlex
    import subprocess

    sweep = tmp_path / "sw"
    args = ["submit", "-m", "recipe=tiny_ddp", "cluster=slurm", "optim.lr=1e-3,1e-2", "training.steps=2,4"]
    assert run_cli([*args, f"run.dir={sweep}", "--dry-run"], monkeypatch) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --array=0-3\n" in script
    assert f"#SBATCH --output={sweep}/logs/slurm-%A_%a.out" in script
    dirs = script[script.index("run_dirs=(\n") + len("run_dirs=(\n") : script.index("\n)\n")].splitlines()
    assert [shlex.split(d)[0] for d in dirs] == [str(sweep / str(i)) for i in range(4)]
    assert 'exec bash "$run_dir/slurm.sbatch"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not sweep.exists()  # a dry run creates nothing
    # Without Slurm on PATH: every point's run directory and script are written (to submit by hand),
    # then the missing sbatch is named.
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    assert run_cli([*args, f"run.dir={sweep}"], monkeypatch) == 2
    assert "`sbatch` not found" in one_error_line(capsys.readouterr().err)
    for i in range(4):
        assert f"run:\n  name: ''\n  dir: {sweep / str(i)}\n" in (sweep / str(i) / "config.yaml").read_text()
        assert f"DTLAUNCH_RUN_DIR={sweep / str(i)}" in (sweep / str(i) / "slurm.sbatch").read_text()
    assert (sweep / "slurm-array.sbatch").read_text() == script
    # One allocation shape per array: points asking for different node counts are refused.
    assert run_cli([*args[:4], "cluster.nodes=1,2", f"run.dir={sweep}", "--dry-run"], monkeypatch) == 2
    assert "other resources (--nodes=2)" in one_error_line(capsys.readouterr().err)


def test_status_of_a_directory_that_is_not_a_run(tmp_path: Path, monkeypatch, capsys) -> None:
    assert run_cli(["status", str(tmp_path)], monkeypatch) == 2
    assert "not a dtlaunch run directory" in one_error_line(capsys.readouterr().err)
    assert run_cli(["status", str(tmp_path / "missing")], monkeypatch) == 2
    assert "not found" in one_error_line(capsys.readouterr().err)
    assert run_cli(["status", "--root", str(tmp_path / "missing")], monkeypatch) == 2
    assert "no runs under" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "args", [["recipe=llama405b_3d", "--search"], ["recipe=llama8b_fsdp", "--search"], ["recipe=llama8b_ddp"]]
)
def test_plan_tables_fit_80_columns_without_cutting_values(args, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    run_cli(["plan", *args], monkeypatch)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out
    assert "…" not in out, out  # rich's mark of a cut value
    if "recipe=llama405b_3d" in args:
        # Pipeline stages one a line, each figure whole; the layout search's schedule names whole.
        assert any(ln.split("│")[-2].strip().startswith("15: ") for ln in lines if ln.count("│") >= 3), out
        assert "interleaved_1f1b" in out or "1f1b" in out, out


def test_every_environment_variable_read_is_documented() -> None:
    import re

    import dtlaunch

    src = Path(dtlaunch.__file__).parent
    # The environment-variable table lives in the configuration guide; the README links it.
    readme = (src.parent / "docs" / "configuration.md").read_text()
    names: set[str] = set()
    for path in src.rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"environ(?:\.get)?[\[(]\"([A-Z_]+)\"", text))
        names |= set(re.findall(r"_ENV = \"([A-Z_]+)\"", text))
        for group in re.findall(r"for var in \(([^)]*)\)", text):  # variables read in a loop
            names |= set(re.findall(r"\"([A-Z_]+)\"", group))
    assert {"DTLAUNCH_DEBUG", "DTLAUNCH_PROGRESS", "DTLAUNCH_RECIPE_PATH"} <= names, names
    missing = sorted(n for n in names if f"`{n}" not in readme)
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_completion_of_recipes_groups_and_keys(monkeypatch, capsys) -> None:
    from dtlaunch.cli import app
    from dtlaunch.job.completion import complete_override, complete_words
    from dtlaunch.job.compose import group_options, list_recipes

    assert complete_override("recipe=tiny_") == sorted(f"recipe={r}" for r in list_recipes() if r.startswith("tiny_"))
    assert complete_override("model=") == [f"model={o}" for o in group_options("model")]
    assert "training.steps=" in complete_override("training.") and "training.steps=" in complete_override("training.st")
    assert complete_override("model.rope_scaling.fac") == ["model.rope_scaling.factor="]
    assert complete_override("training.compile=") == ["training.compile=true", "training.compile=false"]
    assert {"recipe=", "model=", "model.", "training."} <= set(complete_override(""))
    assert complete_override("+training.se") == ["+training.seed=", "+training.seq_len="]
    # Bash splits `model=lla` at '=': the key arrives as the previous word.
    assert complete_words(["model", "="], "llama3_8") == ["llama3_8b"]
    # Through the real CLI, as the shell's completion script asks (zsh protocol).
    monkeypatch.setenv("_DTLAUNCH_COMPLETE", "complete_zsh")
    monkeypatch.setenv("_TYPER_COMPLETE_ARGS", "dtlaunch train recipe=tiny_ddp strategy=zer")
    monkeypatch.setattr(sys, "argv", ["dtlaunch"])
    with pytest.raises(SystemExit):
        app(prog_name="dtlaunch")
    out = capsys.readouterr().out
    assert '"strategy=zero1"' in out and '"strategy=zero3"' in out and "ddp" not in out, out
