"""Tokenizers: the built-in byte tokenizer, a local HF tokenizer.json, dtype and vocab rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtlaunch.data.prepare import prepare_corpus
from dtlaunch.data.shards import open_shards
from dtlaunch.data.tokenizer import BYTE_EOS, ByteTokenizer, check_vocab, load_tokenizer, token_dtype
from dtlaunch.errors import ConfigError, InputError

TEXT = ["def add(a, b):\n    return a + b\n", "héllo wörld — ünïcode\n", "class A:\n    pass\n"]


def build_hf_tokenizer(path: Path) -> Path:
    """Train a tiny BPE offline with the `tokenizers` trainers and save it as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 20, trainer=trainer)
    tok.save(str(path))
    return path


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258 and tok.eos_id == BYTE_EOS == 257
    data = TEXT[1].encode()
    ids = tok.encode(data)
    assert ids.dtype == np.uint16 and list(ids) == list(data)
    assert tok.decode(list(ids) + [257]) == TEXT[1]


def test_dtype_rule() -> None:
    assert token_dtype(258) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32 and token_dtype(128256) == np.uint32


def test_documents_are_separated_by_eos(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i, t in enumerate(TEXT):
        (src / f"{i}.txt").write_text(t)
    s = prepare_corpus([str(src)], tmp_path / "out", ByteTokenizer(), pattern="*.txt", shard_tokens=16)
    sh = open_shards(str(tmp_path / "out"))
    ids = sh.window(0, sh.total)
    assert s.files == 3 and s.shards == -(-sh.total // 16) and sh.total == s.tokens
    docs = np.split(ids, np.where(ids == BYTE_EOS)[0] + 1)[:-1]
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs] == TEXT  # sorted file order


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    path = build_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json works too
    assert tok.vocab_size <= 300 and tok.eos_id is not None
    src = tmp_path / "a.txt"
    src.write_text(TEXT[0])
    prepare_corpus([str(src)], tmp_path / "out", load_tokenizer(str(path)))
    sh = open_shards(str(tmp_path / "out"))
    ids = sh.window(0, sh.total)
    assert ids[-1] == tok.eos_id and len(ids) < len(TEXT[0]), "BPE merges make fewer ids than bytes"
    assert tok.decode(ids[:-1]) == TEXT[0]
    assert sh.meta["vocab_size"] == tok.vocab_size and sh.meta["dtype"] == "uint16"


def test_bad_tokenizer_specs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="cannot be loaded"):
        load_tokenizer(str(bad))
    with pytest.raises(ConfigError, match="model.vocab_size=256"):
        check_vocab(256, 258, "data.tokenizer='byte'")
    check_vocab(258, 258, "ok")
