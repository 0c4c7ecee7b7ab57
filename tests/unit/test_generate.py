"""`dtlaunch generate`: what it prints and where it stops. Its greedy tokens against transformers', for every
family, are a column of the life-cycle matrix (tests/distributed/test_family_lifecycle.py)."""

from __future__ import annotations

import os

import pytest
import torch

from dtlaunch.infer.generate import generate_ids, load_source, set_positions

transformers = pytest.importorskip("transformers")
PROMPT = "w3 w17 w42 w5 w99 w8"


def test_cli_prints_only_the_continuation(tiny_hf_dirs) -> None:
    path = tiny_hf_dirs["qwen3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from cli_server import run_dtlaunch

    args = ["generate", f"hf:{path}", "--prompt", PROMPT, "--max-new-tokens", "5"]
    greedy = run_dtlaunch([*args, "--temperature", "0"], env=env, timeout=300)
    assert greedy.returncode == 0, greedy.stderr
    words = greedy.stdout.split()
    assert 1 <= len(words) <= 5 and all(w in {f"w{i}" for i in range(250)} | {"<unk>"} for w in words)
    assert "loaded qwen3" in greedy.stderr
    from dtlaunch.errors import DtlaunchError

    with pytest.raises(DtlaunchError, match="config.json"):
        load_source(f"hf:{path}/nope", torch.device("cpu"))


def test_generation_stops_at_every_end_of_turn_id_as_transformers(tiny_hf_dirs, tmp_path, capsys) -> None:
    """generation_config.json's eos_token_id list (EOS and end-of-turn ids) ends a continuation in `generate`,
    as in transformers' generate; a continuation that runs to --max-new-tokens says so."""
    import shutil

    from dtlaunch.commands.generate import generate_command

    path = tmp_path / "model"
    shutil.copytree(tiny_hf_dirs["qwen2"], path)
    loaded = load_source(f"hf:{path}", torch.device("cpu"))
    prompt = [int(i) for i in loaded.tokenizer.encode(PROMPT.encode())]
    set_positions(loaded.model, len(prompt) + 12)
    free = generate_ids(loaded.model, prompt, 12, eos_id=loaded.eos_id)
    turn_end = next(t for t in free[3:] if t not in free[:3])  # an id greedy decoding reaches after 3+ tokens
    generate_command(f"hf:{path}", PROMPT, 12, 0.0, 1.0, 0)
    assert "hit --max-new-tokens 12" in capsys.readouterr().err
    (path / "generation_config.json").write_text(f'{{"eos_token_id": [{loaded.eos_id}, {turn_end}]}}')
    loaded = load_source(f"hf:{path}", torch.device("cpu"))
    assert turn_end in loaded.stop_ids
    set_positions(loaded.model, len(prompt) + 12)
    ours = generate_ids(loaded.model, prompt, 12, eos_id=loaded.eos_id, stop=loaded.stop_ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours == out[0, len(prompt) :].tolist() == free[: free.index(turn_end) + 1]
    generate_command(f"hf:{path}", PROMPT, 12, 0.0, 1.0, 0)
    printed = capsys.readouterr()
    assert "hit --max-new-tokens" not in printed.err and len(printed.out.split()) == free.index(turn_end)
    # `dtlaunch eval`'s generation (lm-eval's generate_until) stops there too, and counts the cut ones.
    pytest.importorskip("lm_eval")
    from dtlaunch.infer.lm_eval_adapter import DtlaunchLM

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<eos>")
    lm = DtlaunchLM(loaded, tok, torch.device("cpu"), 1)
    assert lm._generate_row(prompt, 12, [], 0.0, 1.0) == ours and lm.hit_max_length == 0
    assert lm._generate_row(prompt, 2, [], 0.0, 1.0) == ours[:2] and (lm.hit_max_length, lm.generations) == (1, 2)
