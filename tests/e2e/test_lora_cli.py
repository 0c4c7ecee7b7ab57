"""LoRA fine-tuning through the CLI as a user runs it, on a tiny Llama saved by transformers (`hf:DIR`).

- FSDP2 (ZeRO-3) and TP runs export their adapters in peft's format: `peft.PeftModel.from_pretrained`
  loads them without a warning about the adapter and gives dtlaunch's fp32 logits within 1e-4; the merged
  `--format hf` export equals peft's `merge_and_unload` within 1e-5;
- a worker SIGKILLed mid-run restarts from the adapters' checkpoint with bit-identical losses; the FSDP
  checkpoint resumes on the TP layout on the same trajectory (within 1e-4); checkpoints hold no base weight;
- `generate RUN` and `generate hf:DIR --adapter DIR` continue a prompt identically;
- a changed base is refused (exit 2, one line) at resume and at export; a run without adapters cannot be
  exported as peft.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from cli_server import run_dtlaunch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = [
    "peft=lora",
    f"training.steps={STEPS}",
    "training.seq_len=32",
    "training.global_batch=8",
    "optim.lr=2e-2",
    "optim.warmup_steps=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=3",
    "data=synthetic",
    "launch.nproc_per_node=2",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports: nothing here reads its files
    "training.sync_interval_s=0",
]
FSDP = ["strategy=zero3", "training.micro_batch=4"]
TP = ["strategy=tp", "strategy.tp=2", "training.micro_batch=4"]


def dtlaunch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", HF_HUB_OFFLINE="1")
    return run_dtlaunch([*args], env=env, timeout=600)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def losses(run: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def base(tiny_hf_dirs: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny Llama (the refusal test changes a copy of it, never this one)."""
    path = tmp_path_factory.mktemp("lora_base") / "llama"
    shutil.copytree(tiny_hf_dirs["llama_tied"], path)
    return path


@pytest.fixture(scope="module")
def runs(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_runs")
    src = [f"model.init_from=hf:{base}", f"data.tokenizer={base / 'tokenizer.json'}"]
    out = {}
    for name, layout in (("fsdp", FSDP), ("tp", TP)):
        out[name] = root / name
        ok(dtlaunch("train", *COMMON, *src, *layout, f"run.dir={out[name]}"))
    return out


@pytest.fixture(scope="module")
def exports(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Each run's peft adapter directory and merged model directory."""
    root = tmp_path_factory.mktemp("lora_exports")
    out: dict[str, dict[str, Path]] = {}
    for name, run in runs.items():
        out[name] = {fmt: root / f"{name}_{fmt}" for fmt in ("peft", "hf")}
        for fmt, path in out[name].items():
            ok(dtlaunch("ckpt", "export", str(run), "--format", fmt, "--out", str(path)))
    return out


def our_logits(run: Path, tokens: torch.Tensor) -> torch.Tensor:
    """dtlaunch's own model with the run's adapters (not merged): base from hf:DIR, adapters from the checkpoint."""
    from omegaconf import OmegaConf

    from dtlaunch.convert.adapters import base_dir, load_run_adapters
    from dtlaunch.convert.hf import load_hf_weights
    from dtlaunch.models.lora import apply_lora
    from dtlaunch.models.registry import model_spec

    adapters, info = load_run_adapters(run)
    spec = model_spec(adapters.m)
    model = spec.build(adapters.m, rope_len=64, device="cpu")
    apply_lora(model, spec, OmegaConf.create(adapters.record))
    model.init_weights(0)
    state = {**load_hf_weights(base_dir(adapters.record, "test"), adapters.m), **adapters.tensors}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert [k for k in missing if k != "output.weight"] == [] and unexpected == []  # output: tied
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_peft_round_trip_and_merged_export(runs: dict, exports: dict, base: Path, layout: str) -> None:
    run = runs[layout]
    import torch.distributed.checkpoint as dcp

    ckpt = run / "checkpoints" / f"step-{STEPS:08d}"
    marker = json.loads((ckpt / "COMPLETE.json").read_text())
    assert marker["peft"]["base"] == f"hf:{base}" and marker["peft"]["base_fingerprint"].startswith("sha256:")
    # The adapters and their optimizer state only: no base weight (the tied head included) is copied.
    keys = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) for k in model_keys), model_keys
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(hf, str(exports[layout]["peft"])).eval()
    # peft's own deprecation notices about transformers' API are not about this adapter.
    about_adapter = [str(w.message) for w in caught if "checkpointing" not in str(w.message)]
    assert about_adapter == []
    with torch.no_grad():
        theirs = model(tokens).logits
        with model.disable_adapter():
            plain = model(tokens).logits
    assert (theirs - plain).abs().max() > 1e-2  # the adapters trained: they change the logits
    assert (our_logits(run, tokens) - theirs).abs().max() <= 1e-4
    merged = model.merge_and_unload().state_dict()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(exports[layout]["hf"]), dtype=torch.float32)
    got = exported.state_dict()
    assert set(got) == set(merged)
    assert max(float((got[k] - merged[k]).abs().max()) for k in merged) <= 1e-5


def test_killed_run_resumes_bit_identical(runs: dict, base: Path, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    src = [f"model.init_from=hf:{base}", f"data.tokenizer={base / 'tokenizer.json'}"]
    kill = ["debug.fail_at_step=3", "debug.fail_rank=1", "debug.fail_mode=sigkill", "launch.max_restarts=1"]
    text = ok(dtlaunch("train", *COMMON, *src, *FSDP, *kill, f"run.dir={run}"))
    assert "resumed from step-00000002" in text
    assert losses(run) == losses(runs["fsdp"])  # exact: adapters, their optimizer state, data and RNG


def test_resume_on_another_layout(runs: dict, base: Path, tmp_path: Path) -> None:
    run = tmp_path / "switched"
    src = [f"model.init_from=hf:{base}", f"data.tokenizer={base / 'tokenizer.json'}"]
    ckpt = runs["fsdp"] / "checkpoints" / "step-00000002"
    text = ok(dtlaunch("train", *COMMON, *src, *TP, f"run.dir={run}", f"checkpoint.load_path={ckpt}"))
    assert "resumed from step-00000002" in text
    got, fsdp, tp = losses(run), losses(runs["fsdp"]), losses(runs["tp"])
    assert sorted(got) == [3, 4]
    for step in range(1, STEPS + 1):  # the two layouts agree, and the switched run follows them
        assert abs(fsdp[step] - tp[step]) <= 1e-4
        if step in got:
            assert abs(got[step] - tp[step]) <= 1e-4


def test_generate_with_run_adapters_and_peft_dir(runs: dict, exports: dict, base: Path) -> None:
    prompt = ["--prompt", "w1 w2 w3 w4", "--max-new-tokens", "6"]
    from_run = dtlaunch("generate", str(runs["fsdp"]), *prompt)
    from_dir = dtlaunch("generate", f"hf:{base}", "--adapter", str(exports["fsdp"]["peft"]), *prompt)
    for proc in (from_run, from_dir):
        ok(proc)
    # (That the adapters change the model's output: test_peft_round_trip_and_merged_export.)
    assert from_run.stdout.strip() and from_run.stdout == from_dir.stdout


def test_changed_base_is_refused(runs: dict, exports: dict, base: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    # The run's own base, changed in place (same shapes, other values: another training of the model).
    moved = tmp_path / "run"
    shutil.copytree(runs["fsdp"], moved)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    line = one_error_line(
        dtlaunch("train", *COMMON, f"model.init_from=hf:{other}", *FSDP, f"run.dir={moved}", "training.steps=6")
    )
    assert "adapters trained on base" in line and "model.init_from" in line
    # A peft export written for the original base, applied to the other one.
    line = one_error_line(
        dtlaunch("generate", f"hf:{other}", "--adapter", str(exports["fsdp"]["peft"]), "--prompt", "w1")
    )
    assert "--adapter" in line and "another base" in line


# A full (no adapters) run with checkpoints: the run test_resume_cli.py and test_input_errors_cli.py use too
# (session cache: no extra launch in the full suite).
FULL_RUN = [
    "recipe=tiny_fsdp",
    "training.micro_batch=2",
    "training.global_batch=4",
    "training.seq_len=32",
    "training.steps=6",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=3",
    "training.loss_plot=false",
]


def test_peft_export_of_full_run_is_refused(reference_run, tmp_path: Path) -> None:
    run = reference_run(*FULL_RUN)  # only read here
    line = one_error_line(dtlaunch("ckpt", "export", str(run), "--format", "peft", "--out", str(tmp_path / "o")))
    assert "holds no adapters" in line and "--format hf" in line
