"""Tokenizers for corpus preparation: a built-in byte-level one and any local HF `tokenizer.json`.

Both expose the same small surface (`vocab_size`, `eos_id`, `encode(bytes) -> np.ndarray`), so the
shard writer does not care which one it holds. The `tokenizers` package is imported only when an HF
tokenizer is asked for: the byte tokenizer must work on a bare install.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.inputs.chat_template import TEMPLATE_FILE
from dtlaunch.run.run_dir import TOKENIZER_FILE, tokenizer_file

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_VOCAB = 258
# Names HF tokenizers commonly give their end-of-document token (GPT-2, Llama 2, Llama 3, Gemma, BERT).
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: Optional[int]

    def encode(self, data: bytes) -> np.ndarray: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclass
class ByteTokenizer:
    """ids 0..255 are the raw bytes, 256 = BOS, 257 = EOS. Lossless on any file, no training."""

    name: str = "byte"
    vocab_size: int = BYTE_VOCAB
    eos_id: Optional[int] = BYTE_EOS
    bos_id: Optional[int] = BYTE_BOS

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json (no network)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer '{path}' needs the 'tokenizers' package: pip install tokenizers (or use tokenizer=byte)"
            ) from exc
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the Rust side raises a plain Exception on bad JSON
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"tokenizer file '{path}' cannot be loaded: {first}; give a valid tokenizer.json") from exc
        self.name = str(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = next((i for i in (self._tok.token_to_id(t) for t in _EOS_NAMES) if i is not None), None)
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """A batch of documents at once (the Rust side spreads it over threads)."""
        return [np.asarray(e.ids, dtype=self._dtype) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids])


def resolve_tokenizer_spec(spec: str, init_from: str = "") -> str:
    """`auto` is the tokenizer.json of the model.init_from=hf:DIR directory, and `byte` for a model without
    one of its own (as compose resolves it: dtlaunch.job.tokenizer_choice); other specs are unchanged."""
    if spec != "auto":
        return spec
    name = hf_name(init_from)
    if name is None:
        return "byte"
    path = Path(name).expanduser() / TOKENIZER_FILE
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer=auto: '{path}' does not exist (model.init_from={init_from}): put the model's "
            f"tokenizer.json there or set data.tokenizer to its path"
        )
    return str(path)


def load_tokenizer(spec: str, init_from: str = "") -> Tokenizer:
    """`byte`, `auto` (see resolve_tokenizer_spec) or a path to a tokenizer.json (or a directory holding one)."""
    spec = resolve_tokenizer_spec(spec, init_from)
    if spec in ("", "byte"):
        return ByteTokenizer()
    path = tokenizer_file(Path(spec).expanduser())
    if not path.is_file():
        raise InputError(f"tokenizer '{spec}' not found: use 'byte' or the path of a local tokenizer.json")
    return HFTokenizer(path)


def check_vocab(model_vocab: int, tokenizer_vocab: int, source: str) -> None:
    """The embedding must have a row for every id the data can hold."""
    if model_vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the vocabulary of {source} ({tokenizer_vocab} ids): "
            f"set model.vocab_size={tokenizer_vocab} or more"
        )


# Files of a Hugging Face tokenizer directory that travel with a run and its exports.
# chat_template.jinja: where transformers' save_pretrained writes the chat template (dtlaunch.inputs.chat_template).
HF_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer_files(tokenizer_json: Path, out: Path) -> list[Path]:
    """Copy tokenizer.json and its companions into `out`; without a tokenizer_config.json, write one naming
    the fast tokenizer class and EOS token, so `AutoTokenizer.from_pretrained(out)` loads it."""
    import json
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_TOKENIZER_FILES:
        src = tokenizer_json.parent / name if name != TOKENIZER_FILE else tokenizer_json
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(out / name)
    if not (out / "tokenizer_config.json").is_file():
        tok = HFTokenizer(tokenizer_json)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if tok.eos_id is not None:
            config["eos_token"] = tok._tok.id_to_token(tok.eos_id)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        copied.append(out / "tokenizer_config.json")
    return copied


def set_chat_template(tokenizer_dir: Path, template: str) -> None:
    """Write `template` as tokenizer_dir's chat template: chat_template.jinja, as transformers' save_pretrained
    does (it takes priority over tokenizer_config.json, whose chat_template entry is dropped so the two
    never disagree)."""
    import json

    (tokenizer_dir / TEMPLATE_FILE).write_text(template, encoding="utf-8")
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.pop("chat_template", None) is not None:
        config_file.write_text(json.dumps(config, indent=1) + "\n")
