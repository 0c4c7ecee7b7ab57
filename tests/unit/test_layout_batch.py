"""Launcher and runtime helpers that need no process group: run dir, torchrun command, failure line,
LR schedule, weight-decay groups, wrapper-free parameter names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dtlaunch.job.compose import compose


def _cfg(*overrides: str):
    return compose(["recipe=tiny_ddp", *overrides]).cfg


def test_run_dir_keeps_previous_config(tmp_path: Path) -> None:
    from dtlaunch.launch.rundir import create_run_dir

    run = tmp_path / "r"
    assert create_run_dir(_cfg(f"run.dir={run}"), "tiny_ddp") == run.resolve()
    assert (run / "logs").is_dir() and "nproc_per_node: 2" in (run / "config.yaml").read_text()
    create_run_dir(_cfg(f"run.dir={run}"), "tiny_ddp")  # same config: nothing to keep
    assert not list(run.glob("config.prev-*.yaml"))
    create_run_dir(_cfg(f"run.dir={run}", "strategy=zero3"), "tiny_ddp")  # a resume on another layout
    assert "zero_stage: 0" in (run / "config.prev-1.yaml").read_text()
    assert "zero_stage: 3" in (run / "config.yaml").read_text()


def test_run_name_from_recipe_and_time(tmp_path: Path) -> None:
    from dtlaunch.launch.rundir import run_dir_for

    d = run_dir_for(_cfg(f"run.root={tmp_path}"), "tiny_ddp")
    assert d.parent == tmp_path and d.name.startswith("tiny_ddp-20")
    assert run_dir_for(_cfg(f"run.root={tmp_path}", "run.name=x"), "tiny_ddp") == tmp_path / "x"


def test_launch_command(tmp_path: Path) -> None:
    from dtlaunch.launch.local import launch_command

    cmd = launch_command(_cfg("launch.max_restarts=2", "launch.threads_per_worker=3"), tmp_path)
    assert cmd.startswith(f"DTLAUNCH_RUN_DIR={tmp_path} OMP_NUM_THREADS=3 ")
    # The collective flight recorder is on unless launch.flight_recorder_entries=0.
    assert f"TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE={tmp_path}/flight_recorder/rank_ " in cmd
    off = launch_command(_cfg("launch.flight_recorder_entries=0"), tmp_path)
    assert "TORCH_FR" not in off and " torchrun " in off
    for part in ("--nproc-per-node=2", "--max-restarts=2", "--standalone", "-m dtlaunch.train.main"):
        assert part in cmd
    multi = launch_command(_cfg("launch.nnodes=2", "launch.rdzv_endpoint=node0:29500"), tmp_path)
    assert "--standalone" not in multi and "--rdzv-endpoint=node0:29500" in multi


def test_dry_run_prints_launch_command(tmp_path: Path) -> None:
    from cli_server import run_dtlaunch

    args = ["train", "recipe=tiny_ddp", f"run.dir={tmp_path}/r", "--dry-run"]
    proc = run_dtlaunch(args, env=dict(os.environ, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if " torchrun " in ln)
    assert line.endswith("-m dtlaunch.train.main") and "--nproc-per-node=2" in line
    assert not (tmp_path / "r").exists()  # a dry run creates nothing


def test_failure_line_names_rank_and_error(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dtlaunch.launch.local import describe_failure

    def error_file(name: str, message: str) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "100"}}}))
        return str(path)

    # Same second: the peer's lost connection must not hide the real error of rank 1.
    failures = {
        0: ProcessFailure(0, 6, 1, error_file("e0.json", "RuntimeError: [gloo/pair.cc:553] Connection closed by peer")),
        1: ProcessFailure(1, 7, 1, error_file("e1.json", "ValueError: bad shape\nmore")),
    }
    line = describe_failure(ChildFailedError("w", failures), tmp_path)
    assert line.startswith("rank 1 failed: ValueError: bad shape (log: ") and "\n" not in line
    # No error file (os._exit): the exit code is named.
    lone = {3: ProcessFailure(3, 8, 7, str(tmp_path / "missing.json"))}
    assert describe_failure(ChildFailedError("w", lone), tmp_path).startswith("rank 3 failed: exited with code 7")
    # Killed by a signal (no Python error at all): the signal is named, and the log still pointed to.
    killed = {2: ProcessFailure(2, 9, -9, str(tmp_path / "missing.json"))}
    line = describe_failure(ChildFailedError("w", killed), tmp_path)
    assert line.startswith("rank 2 failed: ") and "SIGKILL" in line, line
    assert line.endswith(f"(log: {tmp_path / 'logs' / 'rank2.log'})"), line


@pytest.mark.parametrize("schedule,last", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_lr_schedule(schedule: str, last: float) -> None:
    from dtlaunch.train.optim import lr_lambda

    f = lr_lambda(_cfg("optim.warmup_steps=4", "training.steps=20", f"optim.schedule={schedule}"))
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(19) < f(10) <= 1.0 or schedule == "constant"
    assert f(20) == pytest.approx(last)


def test_weight_decay_on_matrices_only() -> None:
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.optim import param_groups

    model = build_model(_cfg().model, device="cpu")
    decay, no_decay = param_groups(model.named_parameters(), 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_wrapped_names_map_to_model_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.parallel.init_weights import materialize_and_init, model_param_name

    cfg = _cfg()
    model = build_model(cfg.model)  # meta
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    names = [model_param_name(n) for n, _ in model.named_parameters()]
    assert "layers.0.attention.wq.weight" in names
    assert model_param_name("module.layers.1._orig_mod.ffn_norm.weight") == "layers.1.ffn_norm.weight"
    materialize_and_init(model, torch.device("cpu"), 7)
    ref = build_model(cfg.model, device="cpu")
    ref.init_weights(7)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(model.rope_cos, ref.rope_cos)
