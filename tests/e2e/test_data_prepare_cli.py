"""`dtlaunch data prepare` as a user runs it: shards a tokens run reads, HF tokenizers, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtlaunch.job.model_schema import typed_job
from dtlaunch.train.data import build_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from cli_server import run_dtlaunch
from test_tokenizer import build_hf_tokenizer  # noqa: E402


def dtlaunch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_dtlaunch([*args], timeout=120)


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "text"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    (d / "sub" / "b.txt").write_text("Pack my box with five dozen liquor jugs.\n" * 40)
    (d / "skip.md").write_text("# not matched by the pattern\n")
    return d


def tokens_cfg(path: Path, vocab: int) -> object:
    cfg = typed_job({})
    cfg.data.kind, cfg.data.path = "tokens", str(path)
    cfg.model.vocab_size, cfg.training.seq_len, cfg.training.micro_batch = vocab, 32, 4
    return cfg


def test_prepare_then_tokens_run_reads_it(text_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    res = dtlaunch(
        "data", "prepare", str(text_dir), "--out", str(out), "--pattern", "**/*.txt", "--shard-tokens", "1000"
    )
    assert res.returncode == 0, res.stderr
    nbytes = 45 * 40 + 41 * 40
    assert f"prepared 2 files ({nbytes:,} bytes)" in res.stdout and "3,442 tokens in 4 shard(s)" in res.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokens"] == nbytes + 2 and meta["dtype"] == "uint16" and len(meta["shards"]) == 4
    ld = build_loader(tokens_cfg(out, 512), tmp_path, 0, 1)
    batch = ld.next_batch()
    x, y = batch.inputs, batch.targets
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 258
    # A glob over the shards works too, and reads the same samples.
    ld2 = build_loader(tokens_cfg(Path(f"{out}/shard-*.bin"), 512), tmp_path, 0, 1)
    assert torch.equal(ld2.next_batch().inputs, x)


def test_prepare_with_hf_tokenizer(text_dir: Path, tmp_path: Path) -> None:
    tok = build_hf_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "hf"
    res = dtlaunch("data", "prepare", f"{text_dir}/**/*.txt", "--out", str(out), "--tokenizer", str(tok))
    assert res.returncode == 0, res.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == str(tok) and meta["vocab_size"] <= 300 and meta["files"] == 2
    x = build_loader(tokens_cfg(out, 300), tmp_path, 0, 1).next_batch().inputs
    assert int(x.max()) < meta["vocab_size"]


def test_errors_are_one_line_exit_2(text_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    records = tmp_path / "records.jsonl"
    records.write_text('{"body": "a document"}\n{"body": 7}\n')
    cases = [
        # The fix named as this command spells it (--text-field), not as a config key (data.text_field).
        (["data", "prepare", str(records), "--kind", "jsonl", "--out", str(tmp_path / "o4")], "set --text-field"),
        (
            ["data", "prepare", str(records), "--kind", "jsonl", "--text-field", "body", "--out", str(tmp_path / "o5")],
            "set --text-field",
        ),
        (["data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")], "missing"),
        (["data", "prepare", str(empty), "--out", str(tmp_path / "o2")], "empty"),
        (["data", "prepare", str(text_dir), "--pattern", "*.rst", "--out", str(tmp_path / "o3")], "*.rst"),
        (
            ["data", "prepare", str(text_dir), "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path)],
            "nope.json",
        ),
    ]
    for args, needle in cases:
        res = dtlaunch(*args)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dtlaunch: error:") and needle in lines[0], res.stderr


def test_train_refuses_bad_data_before_launch(text_dir: Path, tmp_path: Path) -> None:
    """`dtlaunch train` checks the corpus before any worker starts: one line, exit 2."""
    shards = tmp_path / "shards"
    assert dtlaunch("data", "prepare", str(text_dir), "--out", str(shards)).returncode == 0
    with (shards / "shard-00000.bin").open("r+b") as f:
        f.truncate(101)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.py").write_text("")
    base = ["train", "recipe=tiny_ddp", f"run.root={tmp_path / 'runs'}"]
    cases = [
        (["data=tokens", f"data.path={tmp_path / 'nowhere'}"], "nowhere"),
        (["data=tokens", f"data.path={shards}"], "corrupt"),
        (["data=python_stdlib", f"data.path={empty}"], "empty"),
    ]
    for extra, needle in cases:
        res = dtlaunch(*base, *extra)
        assert res.returncode == 2, (extra, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], res.stderr
