"""Fine-tuning a Hugging Face directory on a user's JSONL, as a new user types it (no tokenizer named):
the run trains on the model's own tokenizer, keeps it, and `dtlaunch generate RUN_DIR` continues a prompt
with exactly the tokens of transformers' greedy loop on the model `ckpt export --format hf` writes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from cli_server import run_dtlaunch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPT = "kalo mimi nupe"
NEW_TOKENS = 12


def dtlaunch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = run_dtlaunch([*args], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_docs, tiny_hf_shape) -> Path:
    """A tiny Llama whose own tokenizer is a byte-level BPE trained on the corpus (ids mean nothing as bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(tiny_docs(200, seed=1), trainer=trainer)
    path = tmp_path_factory.mktemp("tiny_bpe_llama")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    shape = {**tiny_hf_shape, "vocab_size": tok.get_vocab_size()}
    config = transformers.LlamaConfig(**shape, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory, tiny_docs) -> Path:
    base = tmp_path_factory.mktemp("finetune")
    data = base / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in tiny_docs(200, seed=2)))
    run = base / "run"
    args = [f"model.init_from=hf:{model_dir}", "data.kind=jsonl", f"data.path={data}", f"data.cache_dir={base}/cache"]
    short = ["training.steps=4", "training.seq_len=32", "checkpoint.every_steps=4", "optim.lr=1e-2"]
    one = ["launch.nproc_per_node=1", "launch.threads_per_worker=1"]
    dtlaunch("train", "recipe=tiny_fsdp", *args, *short, *one, f"run.dir={run}")
    return run


def test_the_run_trained_on_the_models_tokenizer_and_kept_it(run: Path, model_dir: Path) -> None:
    from dtlaunch.job.compose import load_resolved

    own = model_dir / "tokenizer.json"
    assert load_resolved(run / "config.yaml").data.tokenizer == str(own.resolve())
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == own.read_bytes()
    metas = [json.loads(p.read_text()) for p in run.parent.glob("cache/**/meta.json")]
    assert metas and all(m["tokenizer"] == str(own.resolve()) for m in metas), metas


def test_generate_run_dir_continues_like_transformers_on_the_export(run: Path, tmp_path: Path) -> None:
    out = dtlaunch("generate", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0")
    export = tmp_path / "export"
    dtlaunch("ckpt", "export", str(run), "--format", "hf", "--out", str(export))
    tok = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )[0, len(prompt) :].tolist()
    from dtlaunch.infer.generate import generate_ids, load_source, set_positions

    loaded = load_source(str(run), torch.device("cpu"))
    ours_prompt = [int(i) for i in loaded.tokenizer.encode(PROMPT.encode())]
    assert ours_prompt == prompt
    set_positions(loaded.model, len(prompt) + NEW_TOKENS)
    assert generate_ids(loaded.model, prompt, NEW_TOKENS, eos_id=loaded.eos_id) == ref
    if ref and ref[-1] == tok.eos_token_id:
        ref = ref[:-1]
    assert out.stdout == tok.decode(ref, skip_special_tokens=True) + "\n"
