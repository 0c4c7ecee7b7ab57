"""Checkpoint integrity by content: COMPLETE.json records a checksum per file, computed while DCP writes;
a right-size file with garbage inside is detected, resume falls back to the newest intact step and the
`ckpt` commands name the step they use. Single process, no process group."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dtlaunch.job.compose import compose
from dtlaunch.models.dense.model import build_model
from dtlaunch.run.checkpoints import MARKER, STATE_FILE, check_checkpoint, step_dir_name
from dtlaunch.run.checksums import digest_file
from dtlaunch.train.checkpoint.manager import CheckpointManager
from dtlaunch.train.optim import build_optimizer, build_scheduler
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _manager(run_dir: Path) -> tuple:
    cfg = compose(["model=tiny", "hardware=cpu", "training.seq_len=16", "strategy.dp_shard=1"]).cfg
    torch.manual_seed(0)
    model = build_model(cfg.model, rope_len=16, device="cpu")
    materialize_and_init(model, torch.device("cpu"), seed=0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg)
    return cfg, model, CheckpointManager(cfg, run_dir, [model], [opt], [sched], None, rank=0)


def spoil(f: Path) -> None:
    """Same size, different bytes (a torn write or a bad sector)."""
    data = bytearray(f.read_bytes())
    for i in range(0, len(data), max(1, len(data) // 64)):
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg, model, mgr = _manager(run)
    mgr.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr.save(2)
    from omegaconf import OmegaConf

    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return run


def test_marker_records_a_checksum_of_every_file(two_steps: Path) -> None:
    step = two_steps / "checkpoints" / step_dir_name(2)
    marker = json.loads((step / MARKER).read_text())
    sums = marker["checksums"]
    assert set(sums["files"]) == set(marker["files"]) and ".metadata" in sums["files"] and STATE_FILE in sums["files"]
    # Computed while writing, equal to a hash of the file as it lies on disk.
    for rel, digest in sums["files"].items():
        assert digest_file(step / rel, sums["algorithm"]) == digest, rel
    assert not list(step.glob(".checksums-*"))
    assert check_checkpoint(step, verify=True).verified


@pytest.mark.parametrize("victim", [".metadata", STATE_FILE, "distcp"])
def test_garbage_of_the_right_size_is_detected(victim: str, two_steps: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    step = run / "checkpoints" / step_dir_name(2)
    f = next(step.glob("*.distcp")) if victim == "distcp" else step / victim
    size = f.stat().st_size
    spoil(f)
    assert f.stat().st_size == size
    assert check_checkpoint(step).complete  # sizes alone cannot tell
    info = check_checkpoint(step, verify=True)
    assert not info.complete and f.name in info.reason and "corrupt" in info.reason


def test_resume_falls_back_to_the_newest_intact_step(
    two_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    spoil(run / "checkpoints" / step_dir_name(2) / ".metadata")
    _, _, mgr = _manager(run)
    assert mgr.resume() == 1
    out = capsys.readouterr().out
    assert "skipping checkpoint step-00000002: file .metadata is corrupt" in out
    assert "falling back to step-00000001" in out


def cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from dtlaunch.cli import run

    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return int(exc.value.code or 0), captured.out, captured.err


def test_ckpt_commands_verify_and_name_the_step(
    two_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    code, out, _ = cli(["ckpt", "verify", str(run)], monkeypatch, capsys)
    assert code == 0 and out.count(" ok") >= 2, out
    spoil(run / "checkpoints" / step_dir_name(2) / STATE_FILE)
    code, out, err = cli(["ckpt", "verify", str(run)], monkeypatch, capsys)
    assert code == 2 and "CORRUPT" in out and STATE_FILE in out, out
    assert "step-00000002" in err
    code, out, err = cli(["ckpt", "inspect", str(run)], monkeypatch, capsys)
    assert code == 0, err
    assert "step-00000001" in out and "step-00000002 skipped" in out and STATE_FILE in out
    assert "model" in out and "parameters" in out
    code, out, _ = cli(["ckpt", "inspect", str(run), "--tensors"], monkeypatch, capsys)
    assert "layers.0.attention.wq.weight" in out or "wq" in out
    code, out, err = cli(["ckpt", "inspect", str(run / "checkpoints" / step_dir_name(2))], monkeypatch, capsys)
    assert code == 2 and STATE_FILE in err
    old = os.umask(0o077)
    try:
        code, out, err = cli(
            ["ckpt", "export", str(run), "--format", "torch", "--out", str(tmp_path / "exp")], monkeypatch, capsys
        )
    finally:
        os.umask(old)
    assert code == 0, err
    assert "step-00000001" in out and "step-00000002 skipped" in out
    assert "Warning" not in err and "warn" not in err.lower(), err
    for f in (tmp_path / "exp").iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, (f, oct(f.stat().st_mode))


def test_resume_with_another_model_is_refused_before_launch(
    two_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import dtlaunch.launch.local as local

    monkeypatch.setattr(local, "launch_local", lambda *a, **k: pytest.fail("workers were launched"))
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    args = ["train", "model=tiny", "hardware=cpu", "training.seq_len=16", f"run.dir={run}", "model.dim=128"]
    code, out, err = cli(args, monkeypatch, capsys)
    assert code == 2, err
    assert "step-00000002" in err and "different model" in err and "model.dim: checkpoint 64, config 128" in err, err


def test_workers_trust_the_launchers_verification_of_that_exact_checkpoint(
    two_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher read every byte already: rank 0 skips a second read of the same checkpoint (same path,
    same marker) and reads any other one."""
    import shutil

    from dtlaunch.run.checkpoints import verified_stamp
    from dtlaunch.run.env import VERIFIED_ENV

    shutil.copytree(two_steps / "checkpoints", tmp_path / "c")
    step = tmp_path / "c" / step_dir_name(1)
    spoil(step / STATE_FILE)  # stands in for "not read again": a real read would find it
    monkeypatch.setenv(VERIFIED_ENV, verified_stamp(step))
    assert check_checkpoint(step, verify=True).verified
    monkeypatch.setenv(VERIFIED_ENV, verified_stamp(tmp_path / "c" / step_dir_name(2)))
    assert not check_checkpoint(step, verify=True).complete


def test_reading_a_checkpoint_on_one_process_prints_no_torch_warning(two_steps: Path) -> None:
    """`dtlaunch generate RUN` (and export) read on one process on purpose: DCP's "torch.distributed is
    disabled ..." UserWarning is no news to the user."""
    import warnings

    from dtlaunch.convert.hf import load_checkpoint_model

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state, _, info = load_checkpoint_model(two_steps)
    assert info.path.name == step_dir_name(2) and state
    assert not [w for w in seen if "torch.distributed" in str(w.message)], [str(w.message) for w in seen]
