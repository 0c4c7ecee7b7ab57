"""A Hugging Face model directory (config.json, safetensors, tokenizer files), checked from its
headers: config.json's sizes in range, every weight file's header valid and the layer count and
vocabulary rows the weights hold equal to what config.json says. The tensors' exact shapes against
the model built from config.json are HFWeights' check (dtlaunch.convert.hf), which runs after this one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.inputs.json_file import read_json_object
from dtlaunch.inputs.safetensors_header import read_header
from dtlaunch.run.run_dir import TOKENIZER_FILE

# The directory's weight files: one file, or numbered shards named by an index.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Sizes above this are not a model anyone has (and int32 indexing in kernels stops there).
MAX_SIZE = 2**31 - 1
# config.json keys that are counts (>= 1 when present) and positive finite numbers.
COUNTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "sliding_window",
)
POSITIVE = ("rms_norm_eps", "rope_theta")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TEXT_LAYER = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.")


def check_hf_config(c: Any, path: Path) -> None:
    """config.json's sizes: whole numbers >= 1, epsilons and bases positive and finite."""
    where = f"{path}/config.json"
    if not isinstance(c, dict):
        raise InputError(f"{where} holds a JSON {type(c).__name__}, not an object: restore the model's config.json")
    for key in COUNTS:
        v = c.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
            raise InputError(
                f"{where}: {key}={json.dumps(v)[:40]} is not a size (a whole number in 1..{MAX_SIZE}): "
                "restore the model's config.json"
            )
    for key in POSITIVE:
        v = c.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise InputError(
                f"{where}: {key}={json.dumps(v)[:40]} must be a positive finite number: restore the model's config.json"
            )
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise InputError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}: restore the "
            "model's config.json"
        )
    archs = c.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise InputError(f"{where}: architectures={json.dumps(archs)[:60]} is not a list of names: restore it")
    text = c.get("text_config")
    if isinstance(text, dict):  # a multimodal model's text decoder (Qwen3.5): its sizes too
        check_hf_config(text, path)


def weight_files(path: Path) -> list[str]:
    """The safetensors files of the directory (its index's, or the single file); [] when it has none."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wm.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(
                f"'{index}' is not a valid index ({type(exc).__name__}: {str(exc)[:80]}): restore it, or remove it "
                f"and keep a single {SINGLE_FILE}"
            ) from None
        for f in files:
            if not isinstance(f, str) or "/" in f or f in ("", ".", ".."):
                raise InputError(
                    f"'{index}' names weight file {str(f)[:80]!r}, not a file beside it: restore the index"
                )
        return files
    return [SINGLE_FILE] if (path / SINGLE_FILE).is_file() else []


def read_weight_headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{HF tensor name: (dtype, shape)} over every weight file (headers only)."""
    fix = "restore the file from the model's source (it is spoiled or was cut short while copying)"
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in weight_files(path):
        if not (path / f).is_file():
            raise InputError(f"'{path / f}', named by {INDEX_FILE}, does not exist: restore it")
        out.update(read_header(path / f, fix))
    return out


def check_hf_dir(path: Path, c: dict) -> None:
    """config.json's fields, the weights' headers, and the layers and vocabulary they hold against
    config.json (cheap: before any model of config.json's size is built)."""
    check_hf_config(c, path)
    headers = read_weight_headers(path)
    # A multimodal model (Qwen3.5): its text decoder's sizes, and layers under language_model. (a vision tower
    # has layers of its own).
    text = c.get("text_config")
    c, layer = (text, _TEXT_LAYER) if isinstance(text, dict) else (c, _LAYER)
    if headers:
        layers = {int(m.group(1)) for name in headers if (m := layer.search(name))}
        n = c.get("num_hidden_layers")
        # GLM-4.5 / DeepSeek-V3 checkpoints add their multi-token-prediction layers after the last block.
        mtp = int(c.get("num_nextn_predict_layers") or 0)
        if layers and n is not None and len(layers) not in (n, n + mtp):
            raise InputError(
                f"{path}/config.json: num_hidden_layers={n} but the weights hold {len(layers)} layers: restore the "
                "config.json that came with these weights"
            )
        emb = next((s for name, (_, s) in headers.items() if name.endswith("embed_tokens.weight")), None)
        vocab = c.get("vocab_size")
        if emb and vocab is not None and len(emb) == 2 and emb[0] != vocab:
            raise InputError(
                f"{path}/config.json: vocab_size={vocab} but the embedding holds {emb[0]} rows: restore the "
                "config.json that came with these weights"
            )
    check_tokenizer_files(path)


def check_tokenizer_files(path: Path) -> None:
    """tokenizer.json loads with the tokenizers library; tokenizer_config.json is a JSON object whose
    chat_template, when present, is text or a list of named templates."""
    tok = path / TOKENIZER_FILE
    if tok.is_file():
        check_tokenizer_json(tok)
    conf = path / "tokenizer_config.json"
    if conf.is_file():
        c = read_json_object(conf, f"'{conf}'")
        t = c.get("chat_template")
        named = isinstance(t, list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str) for e in t
        )
        if t is not None and not isinstance(t, str) and not named:
            raise InputError(
                f"'{conf}': chat_template is a {type(t).__name__}, neither text nor a list of {{name, template}}: "
                "restore it"
            )


def check_tokenizer_json(file: Path) -> None:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return  # the byte tokenizer needs no library; whoever loads this file reports the missing package
    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust library raises plain Exception for any malformed file
        raise InputError(
            f"'{file}' is not a tokenizer the tokenizers library can load ({str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__}): "
            "restore the model's tokenizer.json"
        ) from None
