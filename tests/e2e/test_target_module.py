"""`model._target_=pkg.module.build`: a module defined outside dtlaunch (written into a temporary
directory on PYTHONPATH) trains with DDP and FSDP2 + activation checkpointing to the same losses, is
planned by trace, and a bad target is a one-line error with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_server import run_dtlaunch

USER_MODULE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, n_layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h)


def build(m):
    return TinyLM(m.vocab_size, m.dim, m.n_layers)


def not_a_module(m):
    return 42
"""
RUN = [
    "model._target_=user_lm.build",
    "training.steps=3",
    "training.seq_len=32",
    "training.micro_batch=2",
    "data=synthetic",
    "checkpoint.enabled=false",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports: nothing here reads its files
    "launch.threads_per_worker=1",
    "launch.nproc_per_node=2",
    "training.loss_chunks=1",  # the module returns logits only (no `head` argument for a chunked loss)
]


@pytest.fixture(scope="module")
def user_path(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("userpkg")
    (d / "user_lm.py").write_text(USER_MODULE)
    return d


def _dtlaunch(user_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(user_path))
    return run_dtlaunch([*args], env=env, timeout=600)


def test_user_module_trains_in_every_data_parallel_layout(user_path: Path, tmp_path: Path) -> None:
    losses, plans = {}, {}
    for name, layout in {
        "ddp": ["strategy=ddp"],
        "fsdp_ac": ["strategy=fsdp", "training.activation_checkpointing=full"],
    }.items():
        run = tmp_path / name
        proc = _dtlaunch(user_path, "train", *RUN, *layout, f"run.dir={run}")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "planned by tracing one training step" in proc.stdout
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        plan, summary = json.loads((run / "plan.json").read_text()), json.loads((run / "summary.json").read_text())
        plans[name] = (plan["peak_bytes"], max(summary["peak_mem_bytes_per_rank"]))
    assert max(abs(a - b) for a, b in zip(losses["ddp"], losses["fsdp_ac"], strict=True)) < 1e-4
    for predicted, measured in plans.values():
        assert abs(predicted - measured) / measured < 0.10, plans


def test_bad_target_is_one_line_exit_2(user_path: Path) -> None:
    proc = _dtlaunch(user_path, "validate", "model._target_=user_lm.not_a_module")
    assert proc.returncode == 2 and "returned int, not an nn.Module" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model._target_=no_such_pkg.build"], "cannot import no_such_pkg"),
        (["model._target_=user_lm.build", "strategy=tp"], "use strategy.tp=1"),
    ],
)
def test_bad_target_messages(user_path: Path, monkeypatch, overrides: list[str], message: str) -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    monkeypatch.syspath_prepend(str(user_path))
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides).cfg)


def test_chunked_loss_needs_the_head_argument(user_path: Path) -> None:
    """training.loss_chunks > 1 on a module that only returns logits: refused with one line, never run with
    the full-vocabulary loss instead. (The default, auto, chunks only logits of 64 MiB and more: this job's
    are not, so without the override it plans and trains with one full pass.)"""
    plain = [o for o in RUN if not o.startswith("training.loss_chunks")]
    assert _dtlaunch(user_path, "plan", *plain).returncode == 0
    proc = _dtlaunch(user_path, "plan", *plain, "training.loss_chunks=8")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training.loss_chunks=8" in lines[0] and "set training.loss_chunks=1" in lines[0]
