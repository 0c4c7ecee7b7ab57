"""Issue #30 findings 3-5 as a user meets them, in real `dtlaunch` processes: a spoiled model directory,
a broken chat template and an adapter whose r disagrees with its tensors each end in exit 2 and one
line on stderr naming the file; a command substitution in a value runs nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _one_line(proc) -> str:  # noqa: ANN001 - subprocess.CompletedProcess
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_spoiled_files_exit_2_with_one_line(trainer, tiny_hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    import transformers

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_hf_dirs["qwen2"], model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = _one_line(trainer.cli(["generate", f"hf:{model_dir}", "--prompt", "w1", "--max-new-tokens", "1"]))
    assert line.startswith(f"dtlaunch: error: '{weights}' is not a valid safetensors file"), line

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}\n{{ m.__class__.__mro__ }}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    args = ["data.kind=jsonl", f"data.path={data}", f"data.tokenizer={tiny_hf_dirs['qwen2'] / 'tokenizer.json'}"]
    args += ["model.vocab_size=256", "data.format=chat", f"data.chat_template={tpl}"]
    line = _one_line(trainer.cli(["validate", *args]))
    assert line.startswith(f"dtlaunch: error: chat template '{tpl}', line 2: SecurityError"), line

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dirs["qwen2"])
    peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "adapter"
    )
    conf = tmp_path / "adapter" / "adapter_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "r": 4}))
    argv = ["generate", f"hf:{tiny_hf_dirs['qwen2']}", "--adapter", str(tmp_path / "adapter"), "--prompt", "w1"]
    line = _one_line(trainer.cli(argv))
    assert "adapter_config.json says r=4 but" in line and "has rank 8" in line, line


def test_a_command_substitution_in_a_value_runs_nothing(trainer, tmp_path: Path) -> None:
    proc = trainer.cli(["train", "--dry-run", "run.name=$(touch PWNED)", f"run.root={tmp_path}"])
    proc2 = trainer.cli(["validate", "run.name='`touch PWNED`'"])
    assert proc.returncode in (0, 2, 3) and proc2.returncode in (0, 2, 3), proc.stderr + proc2.stderr
    assert not list(tmp_path.rglob("PWNED")) and not Path("PWNED").exists()
