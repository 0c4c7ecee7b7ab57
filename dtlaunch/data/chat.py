"""Chat and prompt/completion records -> token ids plus a loss mask (1 = a token the model learns to
produce), trained as TRL's SFTTrainer trains them (docs/sft-data.md).

A conversation is rendered with transformers' apply_chat_template, using data.chat_template (a built-in
name or a Jinja file) when given, else the tokenizer's own (chat_template.jinja or tokenizer_config.json
beside tokenizer.json). A template that marks assistant text with `{% generation %}` blocks trains exactly
those tokens (transformers' assistant-token mask, TRL's assistant_only_loss). Otherwise which characters
belong to which turn is found by rendering growing prefixes of the conversation: the text an assistant
turn adds, less the generation prompt (its header, which inference writes for the model), is its
target, so the turn's content and its end-of-turn token are trained, as TRL does for conversational
prompt/completion data. The whole rendering is then tokenized once, and a token is a target when its
first character came from an assistant turn's target text.

A prompt/completion record is the ids of prompt + completion, the completion starting where they diverge
from the prompt's own ids (TRL's common prefix), followed by the tokenizer's EOS, which is a target: the
model learns to stop (the EOS is appended by dtlaunch.data.cache.write_tokens, see eos_target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dtlaunch.errors import ConfigError, InputError
from dtlaunch.inputs.chat_template import has_generation_blocks

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
        from dtlaunch.data.chat_templates import BUILTIN, check_template_tokens, chosen_chat_template

        template = chosen_chat_template(chat_template, tokenizer_json)[0]
        if not template and chat:
            raise ConfigError(
                f"data.format=chat needs a chat template, but the tokenizer '{tokenizer_json}' has none: set "
                f"data.chat_template to one of {', '.join(BUILTIN)} or a Jinja file (or use data.format=prompt_completion)"
            )
        self._hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), chat_template=template or None)
        self._backend = self._hf.backend_tokenizer
        check_template_tokens(chat_template, lambda t: self._backend.token_to_id(t) is not None, str(tokenizer_json))
        self.dtype = dtype
        self.generation_blocks = has_generation_blocks(template)

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
        if self.generation_blocks:
            return self._marked(messages, where, key)
        target_chars = bytearray()  # 1 per character of the rendering that is an assistant turn's target text
        before = ""
        for k in range(1, len(messages) + 1):
            text = self._render(messages[:k], where, key)
            if not text.startswith(before):
                raise InputError(
                    f"{key}: the chat template does not render a conversation as the rendering of its first turns "
                    f"plus more text (at {where}); loss masking needs a template that does"
                )
            if messages[k - 1]["role"] == "assistant":
                header = self._header(messages[: k - 1], before, text, where, key)
                target_chars += b"\0" * header + b"\1" * (len(text) - len(before) - header)
            else:
                target_chars += b"\0" * (len(text) - len(before))
            before = text
        # The whole rendering is tokenized at once, so the ids are exactly what the tokenizer gives the
        # conversation (a turn boundary without whitespace, "[/INST]answer", may merge across it); a token
        # belongs to the turn its first character came from.
        enc = self._backend.encode(before, add_special_tokens=False)
        chars = np.frombuffer(bytes(target_chars) + b"\0", dtype=np.uint8)
        starts = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=len(enc.ids))
        return np.asarray(enc.ids, dtype=self.dtype), chars[np.minimum(starts, len(before))].astype(np.uint8)

    def _header(self, earlier: list, before: str, text: str, where: str, key: str) -> int:
        """Characters of an assistant turn that its generation prompt wrote (context, not a target): the
        rendering of the earlier turns with add_generation_prompt, when the turn's rendering extends it."""
        if not earlier:
            return 0
        prompt = self._render(earlier, where, key, add_generation_prompt=True)
        return len(prompt) - len(before) if prompt.startswith(before) and text.startswith(prompt) else 0

    def _marked(self, messages: list, where: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        """A template with `{% generation %}` blocks: transformers' assistant-token mask is the target mask."""
        try:
            out = self._hf.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as exc:  # noqa: BLE001 - the template is user code run on user data (dtlaunch.inputs)
            raise self._template_error(exc, where, key) from None
        return np.asarray(out["input_ids"], dtype=self.dtype), np.asarray(out["assistant_masks"], dtype=np.uint8)

    def _render(self, messages: list, where: str, key: str, add_generation_prompt: bool = False) -> str:
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - the template is user code run on user data (dtlaunch.inputs)
            raise self._template_error(exc, where, key) from None
        if not isinstance(text, str):
            raise InputError(f"{key}: the chat template rendered the record at {where} as no text: fix the template")
        return text

    @staticmethod
    def _template_error(exc: Exception, where: str, key: str) -> InputError:
        from dtlaunch.inputs.chat_template import describe, template_line

        line = template_line(exc)
        return InputError(
            f"{key}: the chat template fails on the record at {where}"
            f"{f' (template line {line})' if line else ''}: {describe(exc)}: fix the record or the template"
        )

    def prompt_completion(self, prompt: Any, completion: Any, where: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InputError(f"{key}: prompt and completion at {where} must be text")
        # As TRL: the completion starts where the ids of the prompt and of prompt + completion diverge.
        p, full = self._ids(prompt), self._ids(prompt + completion)
        shared = next((i for i, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), min(len(p), len(full)))
        mask = np.zeros(len(full), dtype=np.uint8)
        mask[shared:] = 1
        return np.asarray(full, dtype=self.dtype), mask


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
