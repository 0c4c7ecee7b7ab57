"""KTO and reward-model training where they cross the rest of the product: a model with tied embeddings (tiny
Llama; KTO with LoRA adapters, a reward model in full and with LoRA, its score head trained in full beside the
adapters), FSDP2 over 2 workers, every command that checks a job (`validate`, `train --dry-run`), and a worker
SIGKILLed at step 3 whose restart resumes from step 2 and gives the uninterrupted run's losses bit for bit
(adapters, the score head, their optimizer state, the data order and the RNG all restored).

The LoRA reward run's checkpoint is then exported both ways (`ckpt export --format peft` and `--format hf`):
peft loads the adapter directory onto AutoModelForSequenceClassification(num_labels=1) with the score head
from modules_to_save, transformers loads the merged export, and both give the rewards dtlaunch's own model
computes from the checkpoint (fp32, 1e-5); `generate --adapter` refuses the reward model's adapter in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_in_process import run_cli_split

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


@pytest.mark.parametrize(("objective", "peft"), [("kto", "lora"), ("reward", "none"), ("reward", "lora")])
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
    if (objective, peft) == ("reward", "lora"):
        _check_exports(tmp_path / "whole", tiny_hf_dirs["llama_tied"], tmp_path)


def _check_exports(run_dir: Path, base: Path, tmp_path: Path) -> None:
    """--format peft onto the base as a sequence classifier (peft), --format hf (transformers) and the
    checkpoint through dtlaunch's model: the same rewards on the same rows."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from dtlaunch.convert.adapters import merged_run_state
    from dtlaunch.models.registry import model_spec
    from dtlaunch.models.score_head import add_score_head

    exports = {fmt: tmp_path / f"export_{fmt}" for fmt in ("peft", "hf")}
    for fmt, out in exports.items():
        code, err, _ = run_cli_split(["ckpt", "export", str(run_dir), "--format", fmt, "--out", str(out)])
        assert code == 0, err
    config = json.loads((exports["peft"] / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    # A reward model's adapter scores text: `generate --adapter` refuses it in one line.
    code, err, _ = run_cli_split(["generate", f"hf:{base}", "--adapter", str(exports["peft"]), "--prompt", "w1"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "task_type SEQ_CLS" in err, err
    eos = 1  # the tiny tokenizer's, the rows' padding (tests/conftest.py)
    seq = 16
    ids = torch.randint(2, 250, (6, seq), generator=torch.Generator().manual_seed(0))
    ids[1, 9:] = eos  # padded rows: the reward is read before the padding
    ids[4, 12:] = eos

    hf_base = transformers.AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, pad_token_id=eos, dtype=torch.float32
    )
    with_peft = peft.PeftModel.from_pretrained(hf_base, str(exports["peft"])).eval()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(exports["hf"], dtype=torch.float32)
    assert merged.config.pad_token_id == eos and merged.config.num_labels == 1

    state, m, _ = merged_run_state(run_dir)
    ours = model_spec(m).build(m, rope_len=seq, device="cpu")
    ours.init_weights(0)  # RoPE tables; the weights come next
    add_score_head(ours)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        picked = ((ids != eos).int() * torch.arange(seq)).argmax(-1)
        want = ours(ids).squeeze(-1).gather(1, picked[:, None]).squeeze(1)
        got_peft = with_peft(input_ids=ids).logits.squeeze(-1)
        got_hf = merged.eval()(input_ids=ids).logits.squeeze(-1)
    torch.testing.assert_close(got_peft, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_hf, want, rtol=0, atol=1e-5)
    assert want.std() > 1e-3  # the rewards differ from row to row
