"""Export a trained checkpoint to Hugging Face and back, through the CLI.

transformers (a test-only dependency) builds LlamaForCausalLM from the exported config.json and
safetensors with no network; its fp32 logits must equal ours within 1e-4. The reverse import
(`model.init_from=hf:DIR`) must start training from exactly the exported weights.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from cli_server import run_dtlaunch

transformers = pytest.importorskip("transformers")

# Llama-3.1 style RoPE scaling on the tiny model (original context 64 < max 128): exercises rope_scaling.
# A recipe file, because a null section cannot be set from the command line.
RECIPE = """# @package _global_
defaults:
  - override /model: tiny
  - override /strategy: fsdp
  - override /hardware: cpu
  - override /checkpoint: default
model:
  max_seq_len: 128
  rope_theta: 500000.0
  rope_scaling: {factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_seq_len: 64}
launch:
  nproc_per_node: 2
"""
# No tracker (TensorBoard's imports): nothing here reads its files.
TRAIN = ["training.seq_len=32", "training.steps=3", "checkpoint.every_steps=3", "training.loss_plot=false"]
TRAIN += ["logging.trackers=[]"]


def dtlaunch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = run_dtlaunch([*args], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hf")
    (base / "tiny_rope31.yaml").write_text(RECIPE)
    run = base / "run"
    dtlaunch("train", f"recipe={base / 'tiny_rope31.yaml'}", *TRAIN, f"run.dir={run}")
    return run


def our_model(run: Path) -> torch.nn.Module:
    from dtlaunch.convert.hf import load_checkpoint_model
    from dtlaunch.models.dense.model import build_model

    state, m, _ = load_checkpoint_model(run)
    model = build_model(m, device="cpu")
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_logits(out: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["single", "sharded"])
def test_hf_export_logits_match(trained: Path, tmp_path: Path, shard: str) -> None:
    out = tmp_path / "hf"
    extra = ["--max-shard-size", "100KB"] if shard == "sharded" else []
    dtlaunch("ckpt", "export", str(trained), "--format", "hf", "--out", str(out), *extra)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["num_key_value_heads"] == 2
    if shard == "sharded":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (out / "model.safetensors").is_file()
    tokens = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = our_model(trained)(tokens)
    theirs = hf_logits(out, tokens)
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.slow
def test_torch_export_is_plain_tensors(trained: Path, tmp_path: Path) -> None:
    from dtlaunch.convert.hf import load_checkpoint_model

    out = tmp_path / "pt"
    dtlaunch("ckpt", "export", str(trained), "--format", "torch", "--out", str(out))
    exported = torch.load(out / "model.pt", weights_only=True)
    state, _, _ = load_checkpoint_model(trained)
    assert sorted(exported) == sorted(state)
    assert all(torch.equal(exported[k], state[k]) for k in state)


@pytest.mark.slow
def test_init_from_hf_starts_from_exported_weights(trained: Path, tmp_path: Path) -> None:
    from dtlaunch.convert.hf import load_checkpoint_model, load_hf_weights

    out = tmp_path / "hf"
    dtlaunch("ckpt", "export", str(trained), "--format", "hf", "--out", str(out))
    state, m, _ = load_checkpoint_model(trained)
    imported = load_hf_weights(out, m)
    assert all(torch.equal(imported[k], state[k]) for k in state)
    # A fresh run on another layout, initialised from the export; lr 1e-30 is below fp32 rounding of every
    # weight (and lr*wd of 1.0), so one step keeps the weights exactly as loaded and
    # its checkpoint must hold exactly the exported tensors.
    run2 = tmp_path / "run2"
    proc = dtlaunch(
        "train",
        f"recipe={trained.parent / 'tiny_rope31.yaml'}",
        "strategy=ddp",
        "training.seq_len=32",
        "training.steps=1",
        f"run.dir={run2}",
        f"model.init_from=hf:{out}",
        "optim.lr=1e-30",
        "training.loss_plot=false",
        "logging.trackers=[]",
    )
    # Said once (rank 0, although both DDP ranks load it), naming the directory.
    assert proc.stdout.count(f"model.init_from: loaded {len(state)} tensors") == 1, proc.stdout[-3000:]
    assert f"from {out}" in proc.stdout
    again, _, _ = load_checkpoint_model(run2)
    assert all(torch.equal(again[k], state[k]) for k in state)
