"""KTO and reward-model training where they cross the rest of the product: a model with tied embeddings (tiny
Llama; KTO with LoRA adapters, a reward model in full: objective=reward refuses LoRA in one line), FSDP2 over 2 workers, every command that checks a job (`validate`, `train --dry-run`),
and a worker SIGKILLed at step 3 whose restart resumes from step 2 and gives the uninterrupted run's losses bit
for bit (adapters, the score head, their optimizer state, the data order and the RNG all restored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 4
KILL = ["debug.fail_at_step=3", "debug.fail_rank=1", "debug.fail_mode=sigkill", "launch.max_restarts=1"]


def _unpaired(pairs: Path) -> Path:
    """TRL's unpaired format from the pairs: each chosen completion desirable, each rejected one not."""
    out = pairs.with_name("unpaired.jsonl")
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    out.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}) + "\n"
            for r in rows
            for side in ("chosen", "rejected")
        )
    )
    return out


def _job(objective: str, peft: str, data: Path, model: Path, cache: Path) -> list[str]:
    fmt = "unpaired" if objective == "kto" else "preference"
    return [
        f"objective={objective}",
        f"peft={peft}",
        "strategy=zero3",
        "launch.nproc_per_node=2",
        "data.kind=jsonl",
        f"data.format={fmt}",
        f"data.path={data}",
        f"data.cache_dir={cache}",
        f"model.init_from=hf:{model}",
        "training.seq_len=16",
        "training.micro_batch=2",
        "training.global_batch=8",
        f"training.steps={STEPS}",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=2",
    ]


@pytest.mark.parametrize(("objective", "peft"), [("kto", "lora"), ("reward", "none")])
def test_tied_model_checks_then_resumes_bit_identical(
    objective, peft, trainer, tiny_hf_dirs, write_pairs, tmp_path
) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", 48, seed=3)
    data = _unpaired(pairs) if objective == "kto" else pairs
    job = _job(objective, peft, data, tiny_hf_dirs["llama_tied"], tmp_path / "cache")
    for command in (["validate", *job], ["train", *job, f"run.dir={tmp_path / 'dry'}", "--dry-run"]):
        proc = trainer.cli(command)
        assert proc.returncode == 0, f"dtlaunch {command[0]}: {proc.stderr[-1500:]}"

    trainer.run(tmp_path / "whole", *job)
    killed = trainer.run(tmp_path / "killed", *job, *KILL)
    assert "resumed from step-00000002" in killed.stdout + killed.stderr
    whole, resumed = trainer.losses(tmp_path / "whole"), trainer.losses(tmp_path / "killed")
    assert len(whole) == STEPS and whole[0] != whole[-1], whole  # it trained
    assert resumed == whole  # exact
