"""Chat and prompt/completion records -> token ids plus a loss mask (1 = a token the model learns to
produce: assistant turns, or the completion).

A conversation is rendered with transformers' apply_chat_template, using data.chat_template (a built-in
name or a Jinja file) when given, else the tokenizer's own (tokenizer_config.json beside tokenizer.json).
Which characters belong to which turn is found by rendering growing prefixes of the conversation: the
text a turn adds is the difference between the rendering with and without it, so each turn's span is
exact whatever the template looks like. The whole rendering is then tokenized once, and a token is a
target when its first character came from an assistant turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dtlaunch.errors import ConfigError, InputError

ROLES = ("system", "user", "assistant", "tool")
_BATCH = 256


class ChatEncoder:
    def __init__(self, tokenizer_json: Path, dtype: np.dtype, chat_template: str = "", chat: bool = True) -> None:
        """`chat_template` (data.chat_template): a built-in name or a Jinja file, used instead of the
        tokenizer's own template. `chat=False` (prompt/completion records) needs no template."""
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:
            raise ConfigError(
                "data.format=chat needs the 'transformers' package: pip install 'dtlaunch[data]'"
            ) from exc
        from dtlaunch.data.chat_templates import BUILTIN, check_template_tokens, load_chat_template

        if chat_template:
            template = load_chat_template(chat_template)
        else:
            template = tokenizer_chat_template(tokenizer_json)
        if not template and chat:
            raise ConfigError(
                f"data.format=chat needs a chat template, but the tokenizer '{tokenizer_json}' has none: set "
                f"data.chat_template to one of {', '.join(BUILTIN)} or a Jinja file (or use data.format=prompt_completion)"
            )
        self._hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), chat_template=template or None)
        self._backend = self._hf.backend_tokenizer
        check_template_tokens(chat_template, lambda t: self._backend.token_to_id(t) is not None, str(tokenizer_json))
        self.dtype = dtype

    def _ids(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids if text else []

    def chat(self, messages: Any, where: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{key}: the messages at {where} are not a non-empty list of {{role, content}} objects")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InputError(f"{key}: a message at {where} is not a {{role, content}} object: {str(m)[:80]}")
            if m["role"] not in ROLES:
                raise InputError(
                    f"{key}: unknown role '{m['role']}' at {where}: use one of {', '.join(ROLES)} (fix the record)"
                )
        assistant_chars = bytearray()  # 1 per character of the rendering that an assistant turn added
        before = ""
        for k in range(1, len(messages) + 1):
            text = self._render(messages[:k], where, key)
            if not text.startswith(before):
                raise InputError(
                    f"{key}: the chat template does not render a conversation as the rendering of its first turns "
                    f"plus more text (at {where}); loss masking needs a template that does"
                )
            assistant_chars += bytes([messages[k - 1]["role"] == "assistant"]) * (len(text) - len(before))
            before = text
        # The whole rendering is tokenized at once, so the ids are exactly what the tokenizer gives the
        # conversation (a turn boundary without whitespace, "[/INST]answer", may merge across it); a token
        # belongs to the turn its first character came from.
        enc = self._backend.encode(before, add_special_tokens=False)
        chars = np.frombuffer(bytes(assistant_chars) + b"\0", dtype=np.uint8)
        starts = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=len(enc.ids))
        return np.asarray(enc.ids, dtype=self.dtype), chars[np.minimum(starts, len(before))].astype(np.uint8)

    def _render(self, messages: list, where: str, key: str) -> str:
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template is user code run on user data (dtlaunch.inputs)
            from dtlaunch.inputs.chat_template import describe, template_line

            line = template_line(exc)
            raise InputError(
                f"{key}: the chat template fails on the record at {where}"
                f"{f' (template line {line})' if line else ''}: {describe(exc)}: fix the record or the template"
            ) from None
        if not isinstance(text, str):
            raise InputError(f"{key}: the chat template rendered the record at {where} as no text: fix the template")
        return text

    def prompt_completion(self, prompt: Any, completion: Any, where: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InputError(f"{key}: prompt and completion at {where} must be text")
        p, c = self._ids(prompt), self._ids(completion)
        return np.asarray(p + c, dtype=self.dtype), np.asarray([0] * len(p) + [1] * len(c), dtype=np.uint8)


def tokenizer_chat_template(tokenizer_json: Path) -> str:
    """The chat_template of the tokenizer_config.json beside tokenizer.json ("" when it has none)."""
    config_file = tokenizer_json.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or ""


def encode_records(
    encoder: ChatEncoder, fmt: str, records: Iterable[tuple[tuple, str]], key: str
) -> Iterator[tuple[list[tuple[np.ndarray, np.ndarray]], int]]:
    """Batches of (ids, mask) documents and the characters they came from (write_tokens' input)."""
    batch: list[tuple[np.ndarray, np.ndarray]] = []
    chars = 0
    for values, where in records:
        if fmt == "chat":
            doc = encoder.chat(values[0], where, key)
            chars += sum(len(str(m.get("content", ""))) for m in values[0] if isinstance(m, dict))
        else:
            doc = encoder.prompt_completion(values[0], values[1], where, key)
            chars += len(str(values[0])) + len(str(values[1]))
        batch.append(doc)
        if len(batch) >= _BATCH:
            yield batch, chars
            batch, chars = [], 0
    if batch:
        yield batch, chars
