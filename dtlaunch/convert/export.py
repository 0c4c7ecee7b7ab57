"""`dtlaunch ckpt export`: a checkpoint of any layout to Hugging Face safetensors, our own torch file, or
(a LoRA run) peft adapters or the merged model."""

from __future__ import annotations

from pathlib import Path

from dtlaunch.convert.adapters import export_adapters
from dtlaunch.convert.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    export_tokenizer,
    load_checkpoint_model,
    padding_token,
    save_hf,
    save_torch,
)
from dtlaunch.errors import InputError
from dtlaunch.models.score_head import SCORE_HEAD


def export_checkpoint(src: Path, fmt: str, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    if fmt not in ("hf", "torch", "peft"):
        raise InputError(f"--format {fmt!r} is not an export format: use hf, torch or peft")
    adapters = export_adapters(src, fmt, out, max_shard_bytes)  # a LoRA run: its adapters, or merged
    if adapters is not None:
        return adapters
    state, m, info = load_checkpoint_model(src)
    if fmt == "hf":
        # A reward model (objective=reward): its config.json names the token its rows were padded with.
        pad = padding_token(Path(info.path)) if SCORE_HEAD in state else None
        return save_hf(state, m, out, max_shard_bytes, pad_token_id=pad) + export_tokenizer(Path(info.path), out)
    return [save_torch(state, m, out)]
