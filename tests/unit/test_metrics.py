"""MetricsLogger: one JSON line per step, lazy tensor values, TensorBoard events, loss.png, FLOPs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtlaunch.job.model_schema import typed_job
from dtlaunch.models.flops import flops_per_token, matmul_params, mfu
from dtlaunch.models.shapes import param_count
from dtlaunch.train.observe.metrics import MetricsLogger, _Display


def make_cfg(steps: int = 12, log_every: int = 5) -> object:
    cfg = typed_job({})
    cfg.training.steps, cfg.training.log_every = steps, log_every
    cfg.launch.nproc_per_node = 2
    return cfg


class CountingTensor(torch.Tensor):
    """Counts .item() calls: the logger must not sync on every step."""

    calls = 0

    def item(self) -> float:  # type: ignore[override]
        CountingTensor.calls += 1
        return super().item()


def test_lines_per_step_and_lazy_sync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = MetricsLogger(tmp_path, make_cfg(), enabled=True)
    CountingTensor.calls = 0
    for s in range(1, 13):
        loss = torch.tensor(4.0 / s).as_subclass(CountingTensor)
        m.log(s, {"loss": loss, "lr": 1e-3 * s, "grad_norm": torch.tensor(0.5), "tokens": 1024})
        if s < 5:
            assert CountingTensor.calls == 0, "values must stay tensors until the log_every window closes"
            assert (tmp_path / "metrics.jsonl").read_text() == ""
    m.close()
    m.close()  # idempotent
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert recs[3]["loss"] == pytest.approx(1.0) and recs[3]["lr"] == pytest.approx(4e-3)
    for r in recs:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        assert "mfu" not in r, "CPU profile: peak unknown, no MFU"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 2000
    out = capsys.readouterr().out  # not a TTY under pytest: plain lines at each flush (5, 10, 12)
    assert [line.split(" |")[0] for line in out.splitlines()] == ["step 5/12", "step 10/12", "step 12/12"]


def test_tensorboard_reads_every_scalar_of_every_step(tmp_path: Path) -> None:
    """TensorBoard's own reader sees each metric of each step, with the step's value and wall time."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = make_cfg(steps=7, log_every=3)
    cfg.training.loss_plot = False
    m = MetricsLogger(tmp_path, cfg, enabled=True)
    for s in range(1, 8):
        m.log(s, {"loss": 5.0 - s / 2, "lr": 1e-3 * s, "val_loss": 9.0 - s, "skipped": 0})
    m.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/skipped", "val/loss"} <= tags, tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 8))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in recs])
    assert [e.value for e in acc.Scalars("val/loss")] == pytest.approx([9.0 - s for s in range(1, 8)])
    assert [e.wall_time for e in loss] == pytest.approx([r["time"] for r in recs], abs=1e-3)


def test_loss_plot_can_be_turned_off(tmp_path: Path) -> None:
    cfg = make_cfg(steps=2, log_every=1)
    cfg.training.loss_plot = False
    m = MetricsLogger(tmp_path, cfg, enabled=True)
    m.log(1, {"loss": 1.0, "lr": 1e-3})
    m.close()
    assert (tmp_path / "metrics.jsonl").read_text() and not (tmp_path / "loss.png").exists()


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    m = MetricsLogger(tmp_path / "run", make_cfg(), enabled=False)
    m.log(1, {"loss": 1.0})
    m.close()
    assert not (tmp_path / "run").exists()


def test_mfu_when_peak_known_and_nan_loss(tmp_path: Path) -> None:
    cfg = make_cfg(steps=2, log_every=1)
    cfg.hardware.peak_tflops_fp32 = 1.0
    m = MetricsLogger(tmp_path, cfg, enabled=True)
    m.log(1, {"loss": float("nan"), "tokens_per_s": 1000.0})
    m.log(2, {"loss": 2.0, "tokens_per_s": 1000.0})
    m.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["loss"] is None, "NaN is written as null (valid JSON)"
    want = 1000.0 * flops_per_token(cfg.model, cfg.training.seq_len) / (1e12 * 2)
    assert recs[1]["mfu"] == pytest.approx(want)
    assert "mfu" in _Display.describe(recs[1])


def test_flops_per_token_llama() -> None:
    cfg = make_cfg()
    m, s = cfg.model, 128
    assert matmul_params(m) == param_count(m) - m.vocab_size * m.dim
    # By hand for tiny (dim 128, 4 layers, 4 heads, GQA off, ffn 352, vocab 256):
    attn = 4 * 128 * 128
    ffn = 3 * 128 * 352
    n = 4 * (attn + ffn + 2 * 128) + 128 + 256 * 128
    assert matmul_params(m) == n
    assert flops_per_token(m, s) == 6 * n + 12 * 4 * 128 * s
    assert mfu(100.0, 1e10, 0.0, 8) is None and mfu(100.0, 1e10, 1.0, 1) == pytest.approx(1e-0)
