"""Issue #30 findings 3, 4 and 5: spoiled Hugging Face directories, chat templates and peft adapters end
in one line naming the file and the fix, exit 2, on every path that reads them (validate, train before
any worker, generate) - never `internal error` (exit 1), never accepted silently.

Runs the real console entry point in-process; tests/e2e/test_input_files_cli.py proves the same
endings in real subprocesses.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

from dtlaunch.cli import run


def cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    code = int(exc.value.code or 0)
    assert code == 0 or len(lines) == 1, err  # a refusal is exactly one line
    return code, (lines[-1] if lines else "")


def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import dtlaunch.launch.local as local

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("workers were launched")

    monkeypatch.setattr(local, "launch_local", refuse)


# ---------------------------------------------------------------------------------------------
# Finding 3: spoiled Hugging Face directories.


def _cut_half(d: Path) -> Path:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f


def _garbage_header(d: Path) -> Path:
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:8] + b"{garbage" + data[16:])
    return f


def _empty(d: Path) -> Path:
    f = d / "model.safetensors"
    f.write_bytes(b"")
    return f


def _negative_vocab(d: Path) -> Path:
    f = d / "config.json"
    c = json.loads(f.read_text())
    c["vocab_size"] = -1
    f.write_text(json.dumps(c))
    return f


SPOILED_HF: dict[str, tuple[Callable[[Path], Path], str]] = {
    "cut_in_half": (_cut_half, "cut short"),
    "garbage_header": (_garbage_header, "header is not JSON"),
    "empty": (_empty, "shorter than the 8-byte header"),
    "negative_vocab": (_negative_vocab, "vocab_size=-1 is not a size"),
}


@pytest.fixture
def spoiled_hf(request: pytest.FixtureRequest, tiny_hf_dirs: dict[str, Path], tmp_path: Path) -> tuple[Path, Path, str]:
    spoil, expected = SPOILED_HF[request.param]
    d = tmp_path / "model"
    shutil.copytree(tiny_hf_dirs["qwen2"], d)
    return d, spoil(d), expected


@pytest.mark.parametrize("spoiled_hf", list(SPOILED_HF), indirect=True)
@pytest.mark.parametrize("command", ["validate", "train", "generate"])
def test_spoiled_hf_directory_exit_2_naming_the_file(
    spoiled_hf: tuple[Path, Path, str],
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d, spoiled, expected = spoiled_hf
    _no_launch(monkeypatch)
    argv = {
        "validate": ["validate", f"model.init_from=hf:{d}"],
        "train": ["train", f"model.init_from=hf:{d}", f"run.dir={tmp_path / 'run'}"],
        "generate": ["generate", f"hf:{d}", "--prompt", "w1 w2", "--max-new-tokens", "2"],
    }[command]
    code, line = cli(argv, monkeypatch, capsys)
    assert code == 2, line
    assert line.startswith("dtlaunch: error: ") and str(spoiled) in line and expected in line, line
    assert "restore" in line, line
    assert not (tmp_path / "run").exists()  # refused before a run directory was made


def test_weights_with_other_layers_than_config_json_are_refused_before_building_the_model(
    tiny_hf_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "model"
    shutil.copytree(tiny_hf_dirs["qwen2"], d)
    c = json.loads((d / "config.json").read_text())
    c["num_hidden_layers"] = 1_000_000  # a meta model this deep would take minutes to build
    (d / "config.json").write_text(json.dumps(c))
    code, line = cli(["validate", f"model.init_from=hf:{d}"], monkeypatch, capsys)
    assert code == 2 and "num_hidden_layers=1000000 but the weights hold 2 layers" in line, line


# ---------------------------------------------------------------------------------------------
# Finding 4: chat template files.

TEMPLATES = {
    "blocked_attribute": (
        "{% for m in messages %}{{ m['content'] }}\n{{ m.__class__.__mro__ }}{% endfor %}",
        "line 2: SecurityError",
    ),
    "syntax_error": ("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", "line 2: TemplateSyntaxError"),
    "range_too_large": ("{% for i in range(10**12) %}x{% endfor %}", "line 1: OverflowError"),
}


def _chat_job(tmp_path: Path, tiny_hf_dirs: dict[str, Path], template: str) -> tuple[list[str], Path]:
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]})
    )
    tpl = tmp_path / "template.jinja"
    tpl.write_text(template)
    tok = tiny_hf_dirs["qwen2"] / "tokenizer.json"
    args = [
        "data.kind=jsonl",
        f"data.path={data}",
        f"data.tokenizer={tok}",
        "model.vocab_size=256",
        "data.format=chat",
        f"data.chat_template={tpl}",
    ]
    return args, tpl


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("command", ["validate", "train"])
def test_bad_chat_template_exit_2_naming_file_and_line(
    name: str,
    command: str,
    tiny_hf_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_launch(monkeypatch)
    text, expected = TEMPLATES[name]
    args, tpl = _chat_job(tmp_path, tiny_hf_dirs, text)
    extra = [f"run.dir={tmp_path / 'run'}"] if command == "train" else []
    code, line = cli([command, *args, *extra], monkeypatch, capsys)
    assert code == 2, line
    assert line.startswith(f"dtlaunch: error: chat template '{tpl}', {expected}"), line
    assert line.endswith("fix the template file (data.chat_template)"), line


def test_a_template_failing_on_one_record_names_the_record_file_and_line(
    tiny_hf_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sample conversation renders; the third record's content (a number) does not."""
    _no_launch(monkeypatch)
    args, _ = _chat_job(tmp_path, tiny_hf_dirs, "{% for m in messages %}{{ m['content'].strip() }} {% endfor %}")
    good = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}
    bad = {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "w2"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [good, good, bad, good]) + "\n")
    code, line = cli(["train", *args, f"run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 2, line
    assert f"the chat template fails on the record at {data}:3 (template line 1)" in line, line


def test_the_tokenizers_own_template_is_checked_too(
    tiny_hf_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args, _ = _chat_job(tmp_path, tiny_hf_dirs, "")
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(tiny_hf_dirs["qwen2"] / "tokenizer.json", tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    args = [a for a in args if not a.startswith(("data.chat_template", "data.tokenizer"))]
    code, line = cli(["validate", *args, f"data.tokenizer={tok / 'tokenizer.json'}"], monkeypatch, capsys)
    assert code == 2 and f"chat_template of '{tok / 'tokenizer_config.json'}', line 1" in line, line


# ---------------------------------------------------------------------------------------------
# Finding 5: peft adapter directories for `generate --adapter`.


@pytest.fixture(scope="module")
def peft_adapter(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real peft LoRA adapter (r=8, alpha=16, q_proj and v_proj) of the qwen2 base, with trained-looking
    (non-zero) B so that merging changes the weights."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dirs["qwen2"])
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    lora.save_pretrained(out)
    return out


def _cut_adapter(d: Path) -> str:
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f"'{f}' is not a valid safetensors file"


def _set_config(key: str, value: object) -> Callable[[Path], str]:
    def spoil(d: Path) -> str:
        f = d / "adapter_config.json"
        c = json.loads(f.read_text())
        c[key] = value
        f.write_text(json.dumps(c))
        return f"--adapter {d}: "

    return spoil


SPOILED_ADAPTERS: dict[str, tuple[Callable[[Path], str], str]] = {
    "cut": (_cut_adapter, "restore the adapter"),
    "rank_4_vs_8": (_set_config("r", 4), "adapter_config.json says r=4 but"),
    "missing_target": (
        _set_config("target_modules", ["q_proj", "v_proj", "wq_proj"]),
        "target_modules names 'wq_proj', which the base has no module of",
    ),
    "untargeted_tensors": (_set_config("target_modules", ["q_proj"]), 'which target_modules ["q_proj"]'),
}


@pytest.mark.parametrize("name", list(SPOILED_ADAPTERS))
def test_spoiled_adapter_exit_2(
    name: str,
    peft_adapter: Path,
    tiny_hf_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d = tmp_path / "adapter"
    shutil.copytree(peft_adapter, d)
    spoil, expected = SPOILED_ADAPTERS[name]
    names = spoil(d)
    argv = [
        "generate",
        f"hf:{tiny_hf_dirs['qwen2']}",
        "--adapter",
        str(d),
        "--prompt",
        "w1 w2",
        "--max-new-tokens",
        "2",
    ]
    code, line = cli(argv, monkeypatch, capsys)
    assert code == 2, line
    assert names in line and expected in line, line


def test_the_unspoiled_adapter_generates(
    peft_adapter: Path,
    tiny_hf_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The checks refuse only what is wrong: the adapter peft wrote merges and generates."""
    argv = ["generate", f"hf:{tiny_hf_dirs['qwen2']}", "--adapter", str(peft_adapter), "--prompt", "w1 w2"]
    code, line = cli([*argv, "--max-new-tokens", "2"], monkeypatch, capsys)
    assert code == 0, line


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, 3])
def test_a_header_whose_dtype_is_not_a_name_is_refused(tmp_path: Path, dtype: object) -> None:
    """Found by the night fuzz: a list as a tensor's dtype was a TypeError (unhashable), exit 1."""
    from dtlaunch.errors import InputError
    from dtlaunch.inputs.safetensors_header import read_header

    header = json.dumps({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(InputError, match="unknown dtype"):
        read_header(file, "restore the file")
