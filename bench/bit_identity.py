"""Per-step losses of a fixed set of tiny `dtlaunch train` runs, for changes that must not move numerics.

Seven layouts (DDP, FSDP2, TP, PP, LoRA on an HF base, DPO with LoRA, MoE with expert parallelism), each
2 gloo workers and 5 steps of fp32 on CPU. Run it before and after a refactor and compare the JSON: a
change that claims "numerics unchanged" must print identical numbers, not merely close ones.

    python bench/bit_identity.py --out before.json
    python bench/bit_identity.py --out after.json && cmp before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

FAST = [
    "training.steps=5",
    "training.seq_len=32",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "checkpoint.enabled=false",
    "launch.nproc_per_node=2",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
]
SYNTHETIC = ["data=synthetic"]
WORDS = [f"w{i}" for i in range(250)]
# The shape of the tests' tiny HF Llama (tests/conftest.py:TINY_HF_SHAPE).
HF_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def tiny_hf_llama(path: Path) -> Path:
    """A seeded random-weight HF Llama directory with a word-level tokenizer over WORDS."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(**HF_SHAPE, rms_norm_eps=1e-6, eos_token_id=1)
    torch.manual_seed(100)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def preference_pairs(path: Path, n: int = 48) -> Path:
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": words(3, 12), "chosen": words(2, 8), "rejected": words(2, 8)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def layouts(root: Path) -> dict[str, list[str]]:
    base = tiny_hf_llama(root / "hf_llama")
    pairs = preference_pairs(root / "pairs.jsonl")
    hf = [f"model.init_from=hf:{base}", f"data.tokenizer={base / 'tokenizer.json'}"]
    return {
        "ddp": [*SYNTHETIC, "recipe=tiny_ddp", "training.micro_batch=4"],
        "fsdp2": [*SYNTHETIC, "recipe=tiny_fsdp", "training.micro_batch=2", "training.global_batch=8"],
        "tp": [*SYNTHETIC, "recipe=tiny_tp", "training.micro_batch=4", "training.grad_clip=0.5"],
        "pp": [*SYNTHETIC, "recipe=tiny_pp", "model=tiny_deep", "training.micro_batch=4"],
        "lora": [*SYNTHETIC, *hf, "peft=lora", "strategy=zero3", "training.micro_batch=4", "training.global_batch=8"],
        "dpo": [
            "objective=dpo",
            "peft=lora",
            "strategy=zero3",
            "data.kind=jsonl",
            "data.format=preference",
            f"data.path={pairs}",
            f"data.cache_dir={root / 'cache'}",
            f"model.init_from=hf:{base}",
            "training.seq_len=16",
            "training.micro_batch=2",
            "training.global_batch=8",
        ],
        "moe_ep": [
            *SYNTHETIC,
            "model=tiny_moe",
            "model.moe.aux_loss_coef=0.01",
            "strategy=zero3",
            "strategy.ep=2",
            "training.micro_batch=2",
            "training.global_batch=4",
            "training.grad_clip=0.5",
        ],
    }


def run(name: str, args: list[str], root: Path) -> list[float]:
    run_dir = root / "runs" / name
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "dtlaunch", "train", *FAST, *args, f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the losses here as JSON (also printed)")
    parser.add_argument("--only", nargs="*", help="run only these layouts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        losses = {}
        for name, overrides in layouts(root).items():
            if args.only and name not in args.only:
                continue
            losses[name] = run(name, overrides, root)
            print(f"{name:7s} {' '.join(repr(x) for x in losses[name])}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(losses, indent=1) + "\n")


if __name__ == "__main__":
    main()
