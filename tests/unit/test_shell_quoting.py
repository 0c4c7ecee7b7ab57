"""Printed launch commands are safe to paste: hostile values go through a real bash as single literal
arguments, and nothing in them runs."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.launch.local import launch_command, torchrun_args, worker_env


def hostile_values(marker: Path) -> list[str]:
    return [
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"a'b\"c; touch {marker}",
        f"line1\ntouch {marker}",
        "two words ; three",
        "x=$HOME",
        ":smile: [bold]y[/bold]",
    ]


def paste(line: str) -> list[str]:
    """Run the printed line in bash with `torchrun` as a function that prints what it received."""
    script = 'torchrun() { printf \'%s\\0\' "$DTLAUNCH_RUN_DIR" "$@"; }\n' + line
    res = subprocess.run(["bash", "-c", script], capture_output=True, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    return res.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("case", range(7))
def test_dry_run_line_round_trips_through_bash(case: int, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    value = hostile_values(marker)[case]
    cfg = load_job(["recipe=tiny_ddp", "launch.nnodes=2", "launch.rdzv_endpoint=node0:29500", "launch.node_rank=0"]).cfg
    cfg.launch.rdzv_id = value
    run_dir = tmp_path / f"runs/{value}"
    line = launch_command(cfg, run_dir, detected_gpus=0)
    subprocess.run(["bash", "-n"], input=line.encode(), check=True)
    args = torchrun_args(cfg, run_dir, 0)
    assert paste(line) == [str(run_dir), *args]
    assert f"--rdzv-id={value}" in args and f"--log-dir={run_dir}/logs/torchrun" in args
    assert "\n" not in line  # one line, whatever the values hold
    env = dict(worker_env(cfg, run_dir, 0))
    if "\n" not in value:  # shlex does not read bash's $'...', which a newline is written in
        words = shlex.split(line)
        assert words == [f"{k}={v}" for k, v in env.items()] + ["torchrun", *args]
    assert not marker.exists()


def test_cli_dry_run_prints_the_line_verbatim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtlaunch.cli import run

    marker = tmp_path / "PWNED"
    name = f"$(touch {marker})`touch {marker}`:smile:"
    hydra_value = "'" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "train", "recipe=tiny_ddp", f"run.name={hydra_value}", "--dry-run"])
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code in (0, None)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if " torchrun " in ln)
    run_dir = (tmp_path / "runs" / name).resolve()
    assert paste(line)[0] == str(run_dir)
    assert f"--log-dir={run_dir}/logs/torchrun" in paste(line)
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_dry_run_line_with_a_newline_in_run_name_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pasted line by line (as a terminal may run it), a command split over lines runs its second half
    as a command of its own: the line printed must be the whole command."""
    from dtlaunch.cli import run

    marker = tmp_path / "PWNED"
    name = f"a\ntouch {marker}\n"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "train", "recipe=tiny_ddp", f"run.name='{name}'", "--dry-run"])
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out.splitlines()
    line = out[out.index("launch command:") + 1]
    run_dir = (tmp_path / "runs" / name).resolve()
    assert line.startswith("DTLAUNCH_RUN_DIR=") and line.endswith("-m dtlaunch.train.main"), line
    assert paste(line)[0] == str(run_dir)
    assert f"--log-dir={run_dir}/logs/torchrun" in paste(line)
    assert not marker.exists()
