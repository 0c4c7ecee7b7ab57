"""Preference tuning through the CLI as a user runs it: `dtlaunch train objective=dpo data.format=preference`.

- LoRA DPO on ZeRO-3 (2 workers) from a tiny Hugging Face Llama: the first step's loss is ln 2 (the policy
  starts as its adapters-off reference), reward metrics are in metrics.jsonl and the end summary, and a
  worker SIGKILLed after a checkpoint restarts and finishes with per-step losses and reward metrics
  identical bit for bit to the uninterrupted run;
- full DPO on a 2-stage pipeline from a tiny untied Hugging Face Qwen2, its frozen reference copy split
  into the stages: the plan holds half a copy per rank, the first loss is ln 2, and a killed worker resumes
  bit for bit;
- a bad record fails before any worker starts: one line naming the file and line, exit 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory, write_pairs) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 48, seed=0)


LORA_ZERO3 = ("peft=lora", "strategy=zero3")


def dpo_args(hf_dir: Path, pairs: Path, cache: Path) -> list[str]:
    return [
        "objective=dpo",
        "peft=lora",
        "strategy=zero3",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={pairs}",
        f"data.cache_dir={cache}",
        f"model.init_from=hf:{hf_dir}",
        "training.seq_len=16",
        "training.micro_batch=2",
        "training.global_batch=8",
        "training.steps=4",
        "optim.lr=5e-2",
        "optim.warmup_steps=1",
        "checkpoint.every_steps=2",
        "training.sync_interval_s=0",
    ]


def per_step(run_dir: Path) -> dict[int, dict]:
    """The last metrics line of each step (a restarted attempt appends)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): {k: r[k] for k in KEYS} for r in rows}


@pytest.mark.slow
def test_lora_dpo_resumes_bit_identical(trainer, tiny_hf_dirs, pairs_file, tmp_path: Path) -> None:
    args = dpo_args(tiny_hf_dirs["llama_tied"], pairs_file, tmp_path / "cache")
    straight = tmp_path / "straight"
    proc = trainer.run(straight, *args, "checkpoint.enabled=true")
    want = per_step(straight)
    assert sorted(want) == [1, 2, 3, 4]
    assert want[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert want[1]["rewards/margins"] == 0.0
    assert want[4]["loss"] != want[1]["loss"] and want[4]["rewards/margins"] != 0.0
    assert "preference   reward accuracy" in proc.stdout
    assert "acc " in proc.stdout  # the live line
    report = trainer.cli(["report", str(straight)])
    assert report.returncode == 0 and "<h2>rewards" in (straight / "report.html").read_text(), report.stderr

    killed = tmp_path / "killed"
    trainer.run(
        killed,
        *args,
        "checkpoint.enabled=true",
        "debug.fail_at_step=3",
        "debug.fail_rank=1",
        "debug.fail_mode=sigkill",
        "launch.max_restarts=1",
    )
    assert per_step(killed) == want


@pytest.mark.slow
def test_full_dpo_on_a_pipeline_resumes_bit_identical(trainer, tiny_hf_dirs, pairs_file, tmp_path: Path) -> None:
    args = [
        *[a for a in dpo_args(tiny_hf_dirs["qwen2"], pairs_file, tmp_path / "cache") if a not in LORA_ZERO3],
        "strategy=pp",
        "strategy.pp_microbatches=2",
    ]
    plan = trainer.cli(["plan", *args, "--json"])
    assert plan.returncode == 0, plan.stderr
    assert all(s["categories"]["reference copy"] > 0 for s in json.loads(plan.stdout)["stages"])
    straight = tmp_path / "straight"
    trainer.run(straight, *args, "checkpoint.enabled=true")
    want = per_step(straight)
    assert want[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and want[4]["loss"] != want[1]["loss"]
    killed = tmp_path / "killed"
    trainer.run(
        killed,
        *args,
        "checkpoint.enabled=true",
        "debug.fail_at_step=3",
        "debug.fail_rank=0",
        "debug.fail_mode=sigkill",
        "launch.max_restarts=1",
    )
    assert per_step(killed) == want


def test_bad_record_names_file_and_line(trainer, tiny_hf_dirs, pairs_file, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = pairs_file.read_text().splitlines()
    lines[4] = json.dumps({"prompt": "w1 w2", "chosen": "w3"})
    bad.write_text("\n".join(lines) + "\n")
    proc = trainer.run(tmp_path / "run", *dpo_args(tiny_hf_dirs["llama_tied"], bad, tmp_path / "c"), expect_ok=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and f"{bad}:5" in err[0] and "'rejected'" in err[0], proc.stderr
