"""data.tokenizer=auto (the default) is the tokenizer of model.init_from=hf:DIR, resolved once by the launcher;
an explicit byte tokenizer against a model with its own is refused unless data.force_tokenizer=true."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose, load_resolved
from dtlaunch.job.validate import validate

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dirs) -> Path:
    return tiny_hf_dirs["llama_tied"]


@pytest.fixture()
def bare_model_dir(model_dir: Path, tmp_path: Path) -> Path:
    """The same model without tokenizer.json (a tokenizer.model only, as some Llama downloads)."""
    out = tmp_path / "bare"
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    (out / "tokenizer.model").write_bytes(b"sentencepiece")
    return out


@pytest.fixture()
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"text": "w1 w2 w3"}) + "\n" for _ in range(4)))
    return path


def test_auto_is_the_models_tokenizer_and_config_names_it(model_dir: Path, jsonl: Path, tmp_path: Path) -> None:
    cfg = compose([f"model.init_from=hf:{model_dir}", "data.kind=jsonl", f"data.path={jsonl}"]).cfg
    assert cfg.data.tokenizer == str((model_dir / "tokenizer.json").resolve())
    validate(cfg)
    from dtlaunch.launch.rundir import create_run_dir

    run = create_run_dir(compose([f"model.init_from=hf:{model_dir}", f"run.dir={tmp_path / 'run'}"]).cfg, "x")
    assert load_resolved(run / "config.yaml").data.tokenizer == str((model_dir / "tokenizer.json").resolve())
    assert compose([]).cfg.data.tokenizer == "byte"  # no hf: model
    explicit = str(model_dir / "tokenizer.json")
    assert compose([f"model.init_from=hf:{model_dir}", f"data.tokenizer={explicit}"]).cfg.data.tokenizer == explicit


def test_explicit_byte_with_the_models_own_tokenizer_is_exit_2_one_line(model_dir: Path, jsonl: Path) -> None:
    args = ["train", "recipe=tiny_fsdp", f"model.init_from=hf:{model_dir}", "data.kind=jsonl", f"data.path={jsonl}"]
    from cli_server import run_dtlaunch

    proc = run_dtlaunch([*args, "data.tokenizer=byte", "--dry-run"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "data.tokenizer=byte" in lines[0] and str(model_dir / "tokenizer.json") in lines[0]
    assert "data.force_tokenizer=true" in lines[0]
    # On purpose (the tiny model's 256 ids cannot hold byte data: synthetic ids here).
    cfg = compose([f"model.init_from=hf:{model_dir}", "data.tokenizer=byte", "data.force_tokenizer=true"]).cfg
    assert any("data.force_tokenizer=true" in note for note in validate(cfg).notes)
    assert cfg.data.tokenizer == "byte"


def test_a_model_without_tokenizer_json(bare_model_dir: Path, model_dir: Path, jsonl: Path) -> None:
    # Synthetic data needs no tokenizer: auto is the byte one.
    assert compose([f"model.init_from=hf:{bare_model_dir}"]).cfg.data.tokenizer == "byte"
    cfg = compose([f"model.init_from=hf:{bare_model_dir}", "data.kind=jsonl", f"data.path={jsonl}"]).cfg
    with pytest.raises(ConfigError, match=r"has no tokenizer\.json \(it holds tokenizer\.model"):
        validate(cfg)
    named = ["data.kind=jsonl", f"data.path={jsonl}", f"data.tokenizer={model_dir / 'tokenizer.json'}"]
    validate(compose([f"model.init_from=hf:{bare_model_dir}", *named]).cfg)


def test_synthetic_run_from_hf_keeps_and_decodes_with_the_models_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    from dtlaunch.infer.generate import _run_tokenizer
    from dtlaunch.launch.run_data import keep_tokenizer
    from dtlaunch.launch.rundir import create_run_dir

    cfg = compose([f"model.init_from=hf:{model_dir}", f"run.dir={tmp_path / 'run'}"]).cfg
    run = create_run_dir(cfg, "x")
    keep_tokenizer(cfg, run)
    kept = run / "tokenizer" / "tokenizer.json"
    assert kept.read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert _run_tokenizer(run / "checkpoints" / "step-00000001") == str(kept)
    # A run from before tokenizers were kept (config.yaml says byte, synthetic data): the model's.
    old = tmp_path / "old"
    old.mkdir()
    text = (run / "config.yaml").read_text().replace(str(cfg.data.tokenizer), "byte")
    (old / "config.yaml").write_text(text)
    assert _run_tokenizer(old / "checkpoints" / "step-00000001") == str((model_dir / "tokenizer.json").resolve())


def test_byte_token_shards_for_a_model_with_its_own_tokenizer_are_refused(model_dir: Path, tmp_path: Path) -> None:
    from dtlaunch.data.prepare import prepare_corpus
    from dtlaunch.data.tokenizer import ByteTokenizer
    from dtlaunch.launch.run_data import prepare_run_data

    (tmp_path / "a.txt").write_text("w1 w2 w3 " * 400)
    prepare_corpus([str(tmp_path / "a.txt")], tmp_path / "shards", ByteTokenizer(), pattern="*.txt")
    over = [f"model.init_from=hf:{model_dir}", "data.kind=tokens", f"data.path={tmp_path / 'shards'}"]
    with pytest.raises(ConfigError, match=r"prepared with the byte tokenizer but model.init_from has its own"):
        prepare_run_data(compose(over).cfg, tmp_path / "run")
