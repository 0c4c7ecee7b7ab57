"""cluster=skypilot: the task YAML `submit --dry-run` prints, read by SkyPilot's own parser.

SkyPilot pins an older click than the rest of the test environment, so it may live in a venv of its own:
$DTLAUNCH_SKY_PYTHON names that interpreter (the Makefile sets it); without it the test environment's
python is used when it can import `sky`, else the parsing tests are skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dtlaunch.cli import run

PARSE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
(res,) = task.resources
print(json.dumps({
    "name": task.name,
    "num_nodes": task.num_nodes,
    "run": task.run,
    "setup": task.setup,
    "envs": dict(task.envs),
    "accelerators": res.accelerators,
    "use_spot": res.use_spot,
    "job_recovery": res.job_recovery,
    "storage": {path: {"name": s.name, "mode": s.mode.value} for path, s in task.storage_mounts.items()},
}))
"""

BASE = ["recipe=tiny_ddp", "cluster=skypilot", "cluster.sky.bucket=acme-runs"]
GPU = ["hardware=h100_80gb", "model=llama3_8b", "strategy=fsdp", "cluster.nodes=2", "training.micro_batch=1"]
GPU += ["training.seq_len=1024", "launch.nproc_per_node=0"]


def sky_python() -> str:
    python = os.environ.get("DTLAUNCH_SKY_PYTHON", "")
    if python:
        return python
    if importlib.util.find_spec("sky") is None:
        pytest.skip("SkyPilot is not installed (set DTLAUNCH_SKY_PYTHON to a python that has it)")
    return sys.executable


def parse_with_skypilot(path: Path) -> dict[str, Any]:
    res = subprocess.run([sky_python(), "-c", PARSE, str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def submit_dry_run(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *args, "--dry-run"])
    with pytest.raises(SystemExit) as exc:
        run()
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    return out


def test_task_parsed_by_skypilot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    overrides = [*BASE, *GPU, "run.name=llama-run", "cluster.sky.use_spot=true", "+cluster.sky.env.NCCL_DEBUG=WARN"]
    overrides += ["cluster.setup=['pip install dtlaunch']", "cluster.sky.max_restarts_on_errors=2"]
    path = tmp_path / "task.yaml"
    path.write_text(submit_dry_run(overrides, monkeypatch, capsys))
    task = parse_with_skypilot(path)
    assert task["name"] == "llama-run" and task["num_nodes"] == 2
    assert task["accelerators"] == {"H100": 8}
    assert task["use_spot"] is True
    assert task["job_recovery"]["recover_on_exit_codes"] == [75]
    assert task["job_recovery"]["max_restarts_on_errors"] == 2
    assert task["storage"] == {"/mnt/dtlaunch": {"name": "acme-runs", "mode": "MOUNT"}}
    assert task["envs"]["NCCL_DEBUG"] == "WARN"
    assert task["setup"].strip() == "pip install dtlaunch"
    assert "dtlaunch train recipe=" in task["run"] and '"$SKYPILOT_NODE_RANK"' in task["run"]
    # The run script is valid shell.
    check = subprocess.run(["bash", "-n"], input=task["run"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["cluster.sky.bucket="], "cluster.sky.bucket"),
        # Named for what it is (a bucket), not for Kubernetes; buckets need 3 characters at least.
        (["cluster.sky.bucket=Acme_Runs"], "cluster.sky.bucket='Acme_Runs' is not a bucket name the clouds accept"),
        (["cluster.sky.bucket=ab"], "cluster.sky.bucket='ab' is not a bucket name the clouds accept"),
        (
            ["hardware=h100_94gb", "launch.nproc_per_node=0", "model=llama3_8b", "strategy=fsdp"],
            "cluster.sky.accelerator",
        ),
        ([*GPU, "launch.nproc_per_node=2"], "launch.nproc_per_node=2"),
        (["cluster.sky.rdzv_port=0"], "cluster.sky.rdzv_port"),
    ],
)
def test_bad_input_refused_before_anything_is_launched(
    args: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *BASE, *args, "run.name=r"])
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, err
    assert len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_submit_without_sky_is_one_line_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *BASE, "run.name=r"])
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert [line for line in err.splitlines() if line.strip()] == [
        "dtlaunch: error: `sky` not found on PATH: install SkyPilot (pipx install skypilot), or print the task "
        "with --dry-run and launch it with `sky jobs launch`"
    ]
    assert not (tmp_path / "runs").exists()
