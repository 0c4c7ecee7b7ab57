"""The Hugging Face form of the byte tokenizer gives ByteTokenizer's ids on any text, decodes them back, and
loads with AutoTokenizer from the files an export writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dtlaunch.data.byte_hf_tokenizer import (  # noqa: E402
    BOS_TOKEN,
    EOS_TOKEN,
    byte_hf_tokenizer,
    byte_to_char,
    write_byte_tokenizer,
)
from dtlaunch.data.tokenizer import BYTE_BOS, BYTE_EOS, ByteTokenizer  # noqa: E402

HF = byte_hf_tokenizer()
BYTES = ByteTokenizer()
# Text that is special-token text, whitespace runs, control bytes and multi-byte characters, besides anything.
TRICKY = st.sampled_from([BOS_TOKEN, EOS_TOKEN, "<|endoftext|>", " ", "  ", "\n", "\t", "\x00", "é", "日本", "🙂", "Ġ"])
TEXT = st.one_of(st.text(), st.lists(st.one_of(TRICKY, st.text(max_size=5))).map("".join))


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_ids_are_byte_tokenizer_ids_and_decode_round_trips(text: str) -> None:
    ids = HF.encode(text, add_special_tokens=False)
    assert ids == BYTES.encode(text.encode()).tolist()
    assert HF(text)["input_ids"] == ids  # lm-eval's batch path, with its default add_special_tokens
    assert HF.decode(ids) == text == BYTES.decode(ids)


def test_table_is_the_byte_level_pre_tokenizers() -> None:
    from tokenizers import pre_tokenizers

    table = byte_to_char()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ascii_text = "".join(map(chr, range(128)))  # one byte each: the pre-tokenizer's characters are table[b]
    assert byte_level.pre_tokenize_str(ascii_text)[0][0] == "".join(table[b] for b in range(128))


def test_special_tokens_and_sizes() -> None:
    assert (HF.bos_token_id, HF.eos_token_id) == (BYTE_BOS, BYTE_EOS) == (BYTES.bos_id, BYTES.eos_id)
    assert len(HF) == BYTES.vocab_size
    assert HF.decode([72, 105, BYTE_EOS], skip_special_tokens=True) == "Hi"


def test_written_files_load_with_auto_tokenizer(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = f"x{EOS_TOKEN} ünï\ncode {BOS_TOKEN}"
    assert loaded.encode(text, add_special_tokens=False) == list(text.encode())
    assert (loaded.bos_token_id, loaded.eos_token_id) == (BYTE_BOS, BYTE_EOS)
    assert loaded.decode(loaded.encode(text)) == text


def _run(tmp_path: Path, *overrides: str) -> Path:
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.rundir import create_run_dir

    return create_run_dir(compose([*overrides, f"run.dir={tmp_path / 'run'}"]).cfg, "x")


def test_export_of_a_byte_text_run_writes_the_byte_tokenizer(tmp_path: Path) -> None:
    from dtlaunch.convert.hf import export_tokenizer

    text = tmp_path / "a.txt"
    text.write_text("some text")
    run = _run(tmp_path, "data.kind=text", f"data.path={text}", "data.tokenizer=byte")
    written = export_tokenizer(run / "checkpoints" / "step-00000002", tmp_path / "export")
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert loaded.encode("a<eos>é", add_special_tokens=False) == list("a<eos>é".encode())


def test_export_of_a_synthetic_run_writes_no_tokenizer(tmp_path: Path) -> None:
    from dtlaunch.convert.hf import export_tokenizer

    run = _run(tmp_path, "data.kind=synthetic")
    assert export_tokenizer(run / "checkpoints" / "step-00000002", tmp_path / "export") == []
    assert not (tmp_path / "export" / "tokenizer.json").exists()


def test_chat_template_eval_after_a_byte_run_is_refused_before_training() -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.job_inputs import check_eval_inputs

    over = ["data.tokenizer=byte", "training.eval_tasks=[arc_easy]", "training.eval_apply_chat_template=true"]
    refusal = r"^training.eval_apply_chat_template=true: .*byte tokenizer.*set it to false"
    with pytest.raises(ConfigError, match=refusal):
        check_eval_inputs(compose(over).cfg)
