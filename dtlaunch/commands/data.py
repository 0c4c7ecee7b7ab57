"""`data prepare`: tokenize text files into token shards a `data.kind=tokens` run reads."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dtlaunch.commands.common import console


def prepare_command(
    inputs: Sequence[str], out: str, tokenizer: str, shard_tokens: int, pattern: str, max_bytes: int
) -> int:
    from dtlaunch.data.prepare import prepare_corpus
    from dtlaunch.data.tokenizer import load_tokenizer
    from dtlaunch.errors import InputError

    if not inputs:
        raise InputError("data prepare needs at least one INPUT: a directory, a text file or a glob")
    if not out.strip():
        raise InputError("--out is empty: give the directory to write the shards into")
    if max_bytes < 0:
        raise InputError(f"--max-bytes must be 0 (no cap) or positive, got {max_bytes}")
    tok = load_tokenizer(tokenizer)
    s = prepare_corpus(inputs, Path(out), tok, pattern=pattern, shard_tokens=shard_tokens, max_bytes=max_bytes)
    console().print(
        f"prepared {s.files:,} files ({s.bytes_read:,} bytes) -> {s.tokens:,} tokens in {s.shards} shard(s) "
        f"of {s.dtype} under {s.out_dir} (tokenizer {tok.name}, vocab {s.vocab_size:,}) in {s.seconds:.1f}s; "
        f"train on it with data.kind=tokens data.path={s.out_dir}",
        markup=False,
        soft_wrap=True,
    )
    return 0
