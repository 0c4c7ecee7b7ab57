"""dtlaunch's byte tokenizer (ids 0..255 = the raw bytes, 256 = BOS, 257 = EOS) as a Hugging Face tokenizer,
for the tools that need one: lm-eval's HFLM (`dtlaunch eval`) and `AutoTokenizer` on an hf export.

A BPE over GPT-2's 256 byte-level characters with no merges: the ByteLevel pre-tokenizer (no regex split,
no prefix space) turns every byte into its character and the vocabulary maps that character back to the
byte's value, so the ids are the bytes. BOS and EOS are added special tokens at 256 and 257; their text
("<bos>", "<eos>") in a document is encoded as bytes (split_special_tokens), as ByteTokenizer encodes it.
`tokenizers` / `transformers` are optional extras: this module imports them only inside its functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtlaunch.data.tokenizer import BYTE_BOS, BYTE_EOS
from dtlaunch.run.run_dir import TOKENIZER_FILE

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the one the ByteLevel pre-tokenizer uses):
    printable Latin-1 bytes are themselves, the others are shifted above U+00FF in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(table.items()))


def byte_backend() -> Any:
    """The `tokenizers.Tokenizer` (what tokenizer.json holds)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    if (tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)) != (BYTE_BOS, BYTE_EOS):  # the ids trained on
        raise RuntimeError(f"byte tokenizer: {BOS_TOKEN}/{EOS_TOKEN} did not land on ids {BYTE_BOS}/{BYTE_EOS}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json: the class AutoTokenizer builds, BOS/EOS, and special-token text kept as bytes."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "split_special_tokens": True,
    }


def byte_hf_tokenizer() -> Any:
    """The transformers tokenizer, as `AutoTokenizer.from_pretrained` loads the files write_byte_tokenizer writes."""
    from transformers import PreTrainedTokenizerFast

    config = {k: v for k, v in tokenizer_config().items() if k != "tokenizer_class"}
    return PreTrainedTokenizerFast(tokenizer_object=byte_backend(), **config)


def write_byte_tokenizer(out: Path) -> list[Path]:
    """tokenizer.json and tokenizer_config.json in `out` (a Hugging Face model directory)."""
    out.mkdir(parents=True, exist_ok=True)
    byte_backend().save(str(out / TOKENIZER_FILE))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    return [out / TOKENIZER_FILE, out / "tokenizer_config.json"]
