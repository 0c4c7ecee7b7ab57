"""JSONL / Parquet / HF dataset readers, the token cache, the held-out split and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from dtlaunch.data.cache import build_entry, cached_tokens, encode_batches, publish_entry, verify_entry
from dtlaunch.data.records import iter_documents
from dtlaunch.data.shards import open_shards
from dtlaunch.data.sources import held_out_split
from dtlaunch.data.tokenizer import load_tokenizer
from dtlaunch.errors import ConfigError, DtlaunchError, InputError
from dtlaunch.job.model_schema import typed_job
from dtlaunch.job.validate import validate
from dtlaunch.launch.run_data import prepare_run_data


@pytest.fixture(scope="module")
def docs(tiny_docs) -> list[str]:
    return tiny_docs(40, seed=3)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, docs) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sources")
    (root / "a.jsonl").write_text("".join(json.dumps({"body": d, "n": 1}) + "\n" for d in docs[:25]))
    (root / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs[25:]) + "\n\n")
    pq.write_table(pa.table({"body": docs}), root / "t.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(str(root / "saved"))
    return {"jsonl": root / "*.jsonl", "parquet": root / "t.parquet", "hf": root / "saved"}


def error(fn, cls=DtlaunchError) -> str:
    with pytest.raises(cls) as exc:
        fn()
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
def test_every_kind_reads_the_same_documents_in_order(sources, docs, kind: str) -> None:
    assert list(iter_documents(kind, str(sources[kind]), "body")) == docs


def test_hf_data_files_offline(tmp_path: Path, docs) -> None:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert list(iter_documents("hf", str(tmp_path), "text")) == docs


def test_cache_builds_once_and_rebuilds_a_corrupt_entry(sources, tiny_tokenizer, tmp_path: Path, docs) -> None:
    tok = load_tokenizer(str(tiny_tokenizer / "tokenizer.json"))
    files = sorted(Path(sources["jsonl"]).parent.glob("*.jsonl"))

    def get():
        texts = iter_documents("jsonl", str(sources["jsonl"]), "body")
        return cached_tokens(tmp_path, files, encode_batches(tok, texts), tok, {"f": 1}, "x")

    entry, built = get()
    assert built and verify_entry(entry) is not None
    shards = open_shards(str(entry))
    expected = np.concatenate([np.append(tok.encode(d.encode()), tok.eos_id) for d in docs])
    assert np.array_equal(shards.window(0, shards.total), expected)
    assert get() == (entry, False), "same inputs and tokenizer: no re-tokenization"
    shard = entry / "shard-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF  # same size, different content: only the checksum sees it
    shard.write_bytes(bytes(raw))
    assert verify_entry(entry) is None
    assert get() == (entry, True), "a corrupt entry is rebuilt"
    assert np.array_equal(open_shards(str(entry)).window(0, len(expected)), expected)
    # Another text field is another entry.
    other, built = cached_tokens(tmp_path, files, encode_batches(tok, ["kaka lolo"]), tok, {"f": 2}, "x")
    assert built and other != entry


def test_a_second_launcher_keeps_the_entry_the_first_published(sources, tiny_tokenizer, tmp_path: Path) -> None:
    """Both nodes of a multi-node job tokenize into the shared cache at once. The one that finishes second
    must not remove the entry the first published (its launcher, then its workers, read it): it keeps
    theirs -- the same directory, files never missing -- and drops its own. A corrupt one is replaced."""
    tok = load_tokenizer(str(tiny_tokenizer / "tokenizer.json"))
    files = sorted(Path(sources["jsonl"]).parent.glob("*.jsonl"))
    texts = list(iter_documents("jsonl", str(sources["jsonl"]), "body"))
    entry, _ = cached_tokens(tmp_path, files, encode_batches(tok, texts), tok, {"f": 1}, "x")
    first = (entry.stat().st_ino, (entry / "shard-00000.bin").stat().st_ino)
    reader = open(entry / "shard-00000.bin", "rb")  # noqa: SIM115 -- held open as node 0's check would
    # The second launcher checked before the first published, so it built the same entry beside it.
    tmp = entry.with_name(entry.name + ".tmp-second")
    build_entry(tmp, encode_batches(tok, texts), tok, 1, "x", "data.path", {"source": {"f": 1}})
    publish_entry(tmp, entry)
    assert (entry.stat().st_ino, (entry / "shard-00000.bin").stat().st_ino) == first
    assert not tmp.exists() and [p.name for p in tmp_path.iterdir()] == [entry.name]
    reader.close()
    (entry / "shard-00000.bin").write_bytes(b"corrupt")
    build_entry(tmp, encode_batches(tok, texts), tok, 1, "x", "data.path", {"source": {"f": 1}})
    publish_entry(tmp, entry)
    assert verify_entry(entry) is not None and [p.name for p in tmp_path.iterdir()] == [entry.name]


def test_held_out_split_is_fixed_and_disjoint() -> None:
    train, val = held_out_split(1000, 0.05)
    assert len(val) == 50 and len(train) == 950 and not set(train) & set(val)
    again_train, again_val = held_out_split(1000, 0.05)
    assert np.array_equal(val, again_val) and np.array_equal(train, again_train)


def make_cfg(**kv):
    cfg = typed_job({})
    for key, value in kv.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def test_bad_records_are_one_line_errors(tmp_path: Path, sources) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ka"}\n{"text": oops}\n')
    assert f"{bad}:2" in error(lambda: list(iter_documents("jsonl", str(bad), "text")), InputError)
    text = error(lambda: list(iter_documents("jsonl", str(sources["jsonl"]), "text")), InputError)
    assert "'text'" in text and "['body', 'n']" in text
    text = error(lambda: list(iter_documents("parquet", str(sources["parquet"]), "text")), InputError)
    assert "column 'text'" in text and "['body']" in text
    assert "column 'text'" in error(lambda: list(iter_documents("hf", str(sources["hf"]), "text")), InputError)
    assert "split 'test'" in error(lambda: list(iter_documents("hf", str(sources["hf"]), "body", "test")), InputError)


def run_cfg(tmp_path: Path, tokenizer: Path, path: Path, **kv):
    base = {
        "model__vocab_size": 512,
        "data__kind": "jsonl",
        "data__path": str(path),
        "data__tokenizer": str(tokenizer),
        "data__cache_dir": str(tmp_path / "cache"),
        "training__seq_len": 16,
        "launch__nproc_per_node": 1,
    }
    return make_cfg(**{**base, **kv})


def test_launcher_refuses_bad_data_before_workers(tmp_path: Path, tiny_tokenizer: Path, sources) -> None:
    tok = tiny_tokenizer / "tokenizer.json"
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    assert "empty" in error(lambda: prepare_run_data(run_cfg(tmp_path, tok, empty), run), InputError)
    good = run_cfg(tmp_path, tok, sources["jsonl"], data__text_field="body")
    prepare_run_data(good, run)
    assert json.loads((run / "data_sources.json").read_text())["train"]
    # A held-out split too small for one global batch of validation.
    small = run_cfg(tmp_path, tok, sources["jsonl"], data__text_field="body", data__val_fraction=0.001)
    small.training.eval_every = 2
    assert "data.val_fraction" in error(lambda: prepare_run_data(small, run), InputError)
    # The tokenizer's vocabulary must fit the model.
    assert "model.vocab_size" in error(
        lambda: prepare_run_data(
            run_cfg(tmp_path, tok, sources["jsonl"], data__text_field="body", model__vocab_size=64), run
        ),
        ConfigError,
    )
    # A cache directory that cannot be created.
    blocked = tmp_path / "file"
    blocked.write_text("")
    cfg = run_cfg(tmp_path, tok, sources["jsonl"], data__text_field="body", data__cache_dir=str(blocked / "sub"))
    assert "data.cache_dir" in error(lambda: prepare_run_data(cfg, run), InputError)


def test_validate_rules(tmp_path: Path, tiny_tokenizer: Path, monkeypatch) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("{}\n")
    tok = str(tiny_tokenizer / "tokenizer.json")
    assert "data.val_path" in error(
        lambda: validate(
            make_cfg(data__kind="jsonl", data__path=str(path), data__tokenizer=tok, training__eval_every=5)
        ),
        ConfigError,
    )
    both = make_cfg(
        data__kind="jsonl", data__path=str(path), data__tokenizer=tok, data__val_path=str(path), data__val_fraction=0.1
    )
    assert "use one of them" in error(lambda: validate(both), ConfigError)
    validate(make_cfg(data__tokenizer="auto"))  # no hf: model: the byte tokenizer
    auto = make_cfg(data__tokenizer="auto", model__init_from=f"hf:{tiny_tokenizer}")
    validate(auto)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    text = error(lambda: validate(make_cfg(logging__trackers=["wandb"])), ConfigError)
    assert "pip install 'dtlaunch[wandb]'" in text


def test_data_prepare_refuses_json_in_text_mode_and_reads_jsonl(tmp_path: Path, sources, tiny_tokenizer) -> None:
    from dtlaunch.commands.data import prepare_command

    jsonl = str(Path(sources["jsonl"]).parent / "a.jsonl")
    text = error(lambda: prepare_command([jsonl], str(tmp_path / "o"), "byte", 1000, "**/*", 0), InputError)
    assert "--kind jsonl" in text
    tok = str(tiny_tokenizer / "tokenizer.json")
    assert prepare_command([jsonl], str(tmp_path / "o"), tok, 1000, "**/*", 0, kind="jsonl", text_field="body") == 0
    assert open_shards(str(tmp_path / "o")).total > 100


def test_chat_encoding_masks_all_but_assistant_tokens(tiny_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    from dtlaunch.data.chat import ChatEncoder

    enc = ChatEncoder(tiny_tokenizer / "tokenizer.json", np.dtype(np.uint16))
    messages = [
        {"role": "system", "content": "kaka"},
        {"role": "user", "content": "lolo mimi"},
        {"role": "assistant", "content": "nunu pepe"},
        {"role": "user", "content": "rara"},
        {"role": "assistant", "content": "sisi"},
    ]
    ids, mask = enc.chat(messages, "x:1", "data.path")
    hf = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    full = hf.apply_chat_template(messages, tokenize=False)
    assert ids.tolist() == hf(full, add_special_tokens=False)["input_ids"]
    learnt = [hf.convert_ids_to_tokens(int(i)) for i, m in zip(ids, mask, strict=True) if m]
    # Each answer and its end of turn; the header is the generation prompt inference writes (context).
    assert learnt == ["nunu", "pepe", "<|im_end|>", "sisi", "<|im_end|>"]
    # As TRL: prompt + completion is one text (spacing belongs to the data); the EOS is appended later.
    ids, mask = enc.prompt_completion("kaka lolo", " mimi", "x:2", "data.path")
    assert mask.tolist() == [0, 0, 1] and len(ids) == 3
    bad = [{"role": "wizard", "content": "kaka"}]
    assert "unknown role 'wizard' at x:3" in error(lambda: enc.chat(bad, "x:3", "data.path"), InputError)


def test_masked_batches_weight_targets_by_the_global_batch(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Micro-batch weights make sum-of-target-losses * weight / accum average to the global target mean."""
    from dtlaunch.train.data import build_loaders

    chats = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "kaka lolo " * (i % 5 + 1)},
                {"role": "assistant", "content": "mimi"},
            ]
        }
        for i in range(200)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = run_cfg(tmp_path, tiny_tokenizer / "tokenizer.json", chats, data__format="chat", training__micro_batch=2)
    run = tmp_path / "run"
    run.mkdir()
    prepare_run_data(cfg, run)
    (one, _), (half, _) = build_loaders(cfg, run, 0, 1), build_loaders(cfg, run, 1, 2)
    one.global_batch = half.global_batch = 4
    b1, b2 = one.next_batch(), one.next_batch()
    t1, t2, w1 = b1.targets, b2.targets, b1.loss_weight
    total = int((t1 != -100).sum() + (t2 != -100).sum())
    assert 0 < total < t1.numel() * 2 and (t1 == -100).any()
    assert w1 == b2.loss_weight == pytest.approx(4 / (2 * total))
    b_half = half.next_batch()
    assert torch_equal(b_half.targets, t2) and b_half.loss_weight == w1


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
