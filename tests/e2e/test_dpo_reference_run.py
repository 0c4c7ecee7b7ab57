"""DPO with a dtlaunch run as its reference (`objective.reference=RUN_DIR`), through the CLI as a user runs it.

A short SFT run from a tiny Hugging Face model (full, or LoRA: its base + merged adapters) is the reference;
`dtlaunch ckpt export RUN --format hf` writes the same run as a model directory. DPO on ZeRO-3 (2 workers)
against reference=RUN must give the per-step losses and reward metrics of reference=hf:DIR (1e-6): both
read the run's newest checkpoint through the same code. A run directory that cannot be a reference fails
before any worker starts, in one line, exit 2.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen")
SFT = ["data=synthetic", "training.seq_len=16", "training.micro_batch=2", "training.steps=2", "optim.lr=5e-2"]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory, write_pairs) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 32, seed=1)


def dpo_args(hf_dir: Path, pairs: Path, cache: Path, reference: str) -> list[str]:
    return [
        "objective=dpo",
        f"objective.reference={reference}",
        "strategy=zero3",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={pairs}",
        f"data.cache_dir={cache}",
        f"model.init_from=hf:{hf_dir}",
        "training.seq_len=16",
        "training.micro_batch=2",
        "training.global_batch=8",
        "training.steps=3",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
    ]


def per_step(trainer, run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in trainer.metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "peft, family, where",
    [("none", "qwen2", "."), ("lora", "llama_tied", "checkpoints/step-00000002")],  # the run, or one checkpoint
)
def test_reference_run_gives_the_exported_references_losses(
    peft, family, where, trainer, tiny_hf_dirs, pairs_file, tmp_path: Path
) -> None:
    base = tiny_hf_dirs[family]
    sft = tmp_path / "sft"
    trainer.run(
        sft, *SFT, f"model.init_from=hf:{base}", f"peft={peft}", "checkpoint.enabled=true", "checkpoint.every_steps=2"
    )
    exported = tmp_path / "exported"
    proc = trainer.cli(["ckpt", "export", str(sft), "--format", "hf", "--out", str(exported)])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    got, want = {}, {}
    assert (sft / where).is_dir()
    for name, ref, out in (("run", str(sft / where), got), ("hf", f"hf:{exported}", want)):
        run = tmp_path / name
        trainer.run(run, *dpo_args(base, pairs_file, tmp_path / "cache", ref))
        out.update(enumerate(per_step(trainer, run)))
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step in want:
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-6), (step, key, got[step], want[step])
    # The SFT run moved away from the base the policy starts from: the reference is not the base.
    assert abs(want[0]["loss"] - math.log(2)) > 1e-4, want[0]


def test_bad_reference_run_fails_before_launch(trainer, tiny_hf_dirs, pairs_file, tmp_path: Path) -> None:
    empty = tmp_path / "empty_run"
    empty.mkdir()
    for ref, words in (
        (str(tmp_path / "missing"), "no such directory"),
        (str(empty), "no complete checkpoint"),
    ):
        proc = trainer.cli(["plan", *dpo_args(tiny_hf_dirs["qwen2"], pairs_file, tmp_path / "c", ref)])
        assert proc.returncode == 2, proc.stdout + proc.stderr
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and "objective.reference=" in err[0] and words in err[0], proc.stderr
