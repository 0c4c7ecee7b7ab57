"""`dtlaunch train -m`: a 2x2 sweep of tiny 2-step single-process runs, one after another, each in its
own run directory under one sweep directory, ending with the table. Two of the four points fail on
purpose (debug.fail_at_step): the others still run, and the exit code says not all succeeded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_server import run_dtlaunch


@pytest.mark.slow
def test_two_by_two_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "train",
        "-m",
        "recipe=tiny_ddp",
        "launch.nproc_per_node=1",
        "launch.threads_per_worker=1",
        "training.steps=2",
        "training.seq_len=32",
        "checkpoint.enabled=false",
        "training.loss_plot=false",
        "optim.lr=1e-3,1e-2",
        "debug.fail_at_step=-1,2",
        f"run.dir={sweep}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100")
    proc = run_dtlaunch([*args], timeout=600, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]  # two points failed
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    record = json.loads((sweep / "sweep.json").read_text())
    status = {tuple(p["swept"]): p["status"] for p in record["points"]}
    assert status == {
        ("optim.lr=0.001", "debug.fail_at_step=-1"): "ok",
        ("optim.lr=0.001", "debug.fail_at_step=2"): "failed (exit 1)",
        ("optim.lr=0.01", "debug.fail_at_step=-1"): "ok",
        ("optim.lr=0.01", "debug.fail_at_step=2"): "failed (exit 1)",
    }, status
    # The table: one row per point with its overrides, the final loss of the runs that finished, status.
    table = proc.stdout[proc.stdout.rindex("sweep\n") :]
    for p in record["points"]:
        row = next(ln for ln in table.splitlines() if ln.startswith(f"{p['index']} "))
        assert " ".join(p["swept"]) in row and p["status"] in row, table
        if p["status"] == "ok":
            summary = json.loads((Path(p["run_dir"]) / "summary.json").read_text())
            assert summary["final_step"] == 2 and f"{summary['final_loss']:.4f}" in row, table
            assert Path(p["run_dir"]).parent == sweep
    # `dtlaunch status` reads the same from each point's directory.
    from dtlaunch.commands.status import local_status

    states = [local_status(Path(p["run_dir"]))["state"] for p in record["points"]]
    assert states == ["finished" if p["status"] == "ok" else "failed" for p in record["points"]], states
