"""Tokenizing a JSONL corpus into the token cache: throughput, peak memory, and the second start.

Generates ~100 MB of JSONL (documents of pseudo-words, a `text` field plus metadata), trains a small
BPE tokenizer (8k ids, `tokenizers`) on its first megabyte, then in a fresh child process each time:
1. tokenizes the corpus into an empty cache (dtlaunch.launch.run_data.tokenize_records, what the launcher
   runs): MB/s of input and the child's peak RSS (ru_maxrss), to show the stream is not held in memory;
2. starts again with the same inputs: the cache entry is verified (sizes + CRC-32 manifest) and reused.

    python bench/tokenize_bench.py [--mb 100] [--workdir /tmp/dtl-tokbench]

Not part of the test suite (no timed assertions); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from omegaconf import OmegaConf
from dtlaunch.config.schema import JobConfig
from dtlaunch.launch.run_data import tokenize_records
cfg = OmegaConf.structured(JobConfig)
cfg.data.kind = "jsonl"
cfg.data.path, cfg.data.tokenizer, cfg.data.cache_dir = sys.argv[1], sys.argv[2], sys.argv[3]
cfg.model.vocab_size = 8192
t0 = time.perf_counter()
entry = tokenize_records(cfg, cfg.data.path, "data.path")
seconds = time.perf_counter() - t0
meta = json.loads((entry / "meta.json").read_text())
print(json.dumps({"seconds": seconds, "tokens": meta["tokens"], "documents": meta["documents"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def make_corpus(path: Path, target_bytes: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "ve", "zo", "ba", "du", "fe", "gi", "ho", "ju", "ly", "qu"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    written = 0
    with path.open("w") as fh:
        i = 0
        while written < target_bytes:
            n = rng.randint(50, 800)
            line = json.dumps({"id": i, "source": "bench", "text": " ".join(rng.choices(words, k=n))}) + "\n"
            fh.write(line)
            written += len(line)
            i += 1
    return written


def train_tokenizer(corpus: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    sample = []
    with corpus.open() as fh:
        for _, line in zip(range(2000), fh, strict=False):
            sample.append(json.loads(line)["text"])
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<|endoftext|>"]))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def run_child(corpus: Path, tok: Path, cache: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(corpus), str(tok), str(cache)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--workdir", default="/tmp/dtl-tokbench")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    size = make_corpus(corpus, int(args.mb * 1e6))
    tok = train_tokenizer(corpus, work / "tok")
    cache = work / "cache"
    first = run_child(corpus, tok, cache)
    second = run_child(corpus, tok, cache)
    mb = size / 1e6
    print(f"corpus: {mb:.1f} MB JSONL, {first['documents']:,} documents -> {first['tokens']:,} tokens (BPE 8k)")
    print("| run | tokenize s | MB/s | child wall s | peak RSS MiB |")
    print("|---|---|---|---|---|")
    print(
        f"| first (builds cache) | {first['seconds']:.2f} | {mb / first['seconds']:.1f} | {first['wall']:.2f} | "
        f"{first['peak_rss'] / 2**20:.0f} |"
    )
    print(
        f"| second (reuses cache) | {second['seconds']:.2f} | - | {second['wall']:.2f} | "
        f"{second['peak_rss'] / 2**20:.0f} |"
    )
    print(f"(this process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
