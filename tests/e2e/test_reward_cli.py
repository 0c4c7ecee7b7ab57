"""objective=reward as a user runs it: `dtlaunch train objective=reward data.format=preference` from a tiny
Hugging Face Llama on ZeRO-3 (2 workers; TRL's centring term and per-pair margins on), then `dtlaunch ckpt
export --format hf`. One run, shared:

- the metrics lines carry TRL's reward metrics (accuracy, margin, mean_reward) and the loss moves;
- the export is a LlamaForSequenceClassification (num_labels 1, pad_token_id the rows' padding, EOS) that
  transformers' AutoModelForSequenceClassification loads, and its rewards on the run's own cached pairs
  equal the checkpoint's rewards through dtlaunch's model and objective (fp32, 1e-5);
- bad input (a text dataset) is one line, exit 2, before any worker starts.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from cli_in_process import run_cli_split

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SEQ = 16  # some pairs are cut (their rows fill it), the others padded
EOS = 1  # the tiny tokenizer's (tests/conftest.py)


@pytest.fixture(scope="module")
def reward_run(trainer, tiny_hf_dirs, write_pairs, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("reward")
    pairs = write_pairs(base / "pairs.jsonl", 48, seed=0)
    # TRL's per-pair margin column, through data.margin_field into the workers' loss
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    pairs.write_text("".join(json.dumps({**r, "margin": (i % 5) / 4}) + "\n" for i, r in enumerate(records)))
    run_dir, cache = base / "run", base / "cache"
    args = [
        "objective=reward",
        "objective.center_rewards_coefficient=0.01",
        "data.margin_field=margin",
        "strategy=zero3",
        "launch.nproc_per_node=2",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={pairs}",
        f"data.cache_dir={cache}",
        f"model.init_from=hf:{tiny_hf_dirs['llama_tied']}",
        f"training.seq_len={SEQ}",
        "training.micro_batch=2",
        "training.global_batch=8",
        "training.steps=3",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=3",
    ]
    trainer.run(run_dir, *args)
    out = base / "export"
    code, err, _ = run_cli_split(["ckpt", "export", str(run_dir), "--format", "hf", "--out", str(out)])
    assert code == 0, err
    return {"run": run_dir, "export": out, "cache": cache, "args": args, "metrics": trainer.metrics(run_dir)}


def test_metrics_carry_trl_reward_names(reward_run) -> None:
    rows = {int(r["step"]): r for r in reward_run["metrics"]}
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert math.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0
        assert {"margin", "mean_reward", "rewards/chosen", "rewards/rejected"} <= set(r)
        assert r["margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
    assert rows[3]["loss"] != rows[1]["loss"]


def test_export_loads_as_sequence_classification_with_equal_rewards(reward_run) -> None:
    from dtlaunch.convert.hf import load_checkpoint_model
    from dtlaunch.data.preference import PairSource
    from dtlaunch.models.registry import model_spec
    from dtlaunch.models.score_head import add_score_head
    from dtlaunch.train.objectives.reward import row_rewards

    config = json.loads((reward_run["export"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 and config["pad_token_id"] == EOS
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_run["export"], dtype=torch.float32)
    hf.eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.pad_token_id == EOS

    # The run's own pairs, as its loader reads them: rows of SEQ + 1 tokens padded with EOS.
    entry = next(p.parent for p in reward_run["cache"].rglob("rows.npy"))
    source = PairSource(str(entry), SEQ, "data.path")
    samples = [source.sample(i) for i in range(8)]
    # (16, 2, SEQ + 1): chosen rows, then rejected rows
    rows = torch.from_numpy(np.stack([s[0] for s in samples] + [s[1] for s in samples]))
    ids, mask = rows[:, 0], rows[:, 1]
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -100

    state, m, _ = load_checkpoint_model(reward_run["run"])
    ours = model_spec(m).build(m, rope_len=SEQ, device="cpu")
    ours.init_weights(0)  # RoPE tables; the weights come next
    add_score_head(ours)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = row_rewards(ours(inputs), targets, EOS)
        got = hf(input_ids=inputs).logits.squeeze(-1)
    picked = ((inputs != EOS).int() * torch.arange(SEQ)).argmax(-1)
    assert (picked < SEQ - 1).any() and (picked == SEQ - 1).any()  # padded rows and full ones
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert want.std() > 1e-3  # the rewards differ from row to row


def test_text_data_is_one_line_exit_2(reward_run, tmp_path) -> None:
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "w1 w2"}\n')
    args = [a for a in reward_run["args"] if not a.startswith(("data.format", "data.path"))]
    code, err, _ = run_cli_split(["validate", *args, f"data.path={text}"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "objective=reward trains on preference pairs, not data.format=text" in err


def test_resume_check_knows_the_score_head(reward_run) -> None:
    """The launcher's resume check builds the model as the workers do: the run's checkpoint (score head, no LM
    head) matches its own config, and not the same config as a language model's."""
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.launch.preflight import check_model_matches
    from dtlaunch.run.checkpoints import resolve_load_path

    cfg = load_resolved(reward_run["run"] / "config.yaml")
    info, _ = resolve_load_path(reward_run["run"])
    check_model_matches(cfg, info)
    cfg.objective.name = "sft"
    with pytest.raises(ConfigError, match="tensor output.weight"):
        check_model_matches(cfg, info)
