"""Preference pairs (data.format=preference): {prompt, chosen, rejected} records -> token rows, cached.

A record's three fields are text, or lists of chat messages rendered with the run's chat template (the
prompt with the generation prompt appended; a completion is what the rendering of prompt + completion
adds). As TRL: an EOS token ends each text completion (a chat completion ends with its template's end of
turn), and the prompt's length is the token prefix that prompt and prompt + completion share.

Cache entry (content-addressed like dtlaunch.data.cache): token shards holding, per pair, the chosen row
then the rejected row (prompt + completion each), and rows.npy, (2 * pairs, 2) int64: each row's prompt
length and total length. The worker's PairSource cuts rows to seq_len + 1 tokens, keeping the end of the
prompt (its start is dropped first), and returns each pair as one sample, so a chosen row and its rejected
row are always in the same micro-batch. With data.margin_field (objective=reward) the entry also holds
margins.npy, (pairs,) float64: each pair's margin, which the loader hands the step beside its micro-batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from dtlaunch.data.cache import _crc32, built_entry, verify_entry
from dtlaunch.data.shards import ShardWriter, open_shards
from dtlaunch.data.tokenizer import token_dtype
from dtlaunch.errors import InputError

ROWS_FILE = "rows.npy"
MARGINS_FILE = "margins.npy"


class PairEncoder:
    """Token ids of a pair's prompt and completions (see the module docstring)."""

    def __init__(self, encoder: Any, eos_id: Optional[int]) -> None:
        self.enc, self.eos = encoder, eos_id  # a dtlaunch.data.chat.ChatEncoder
        self.margins: list[float] = []  # each pair's margin, in order, when the records carry one

    def _row(self, prompt_text: str, completion_text: str, eos: bool) -> tuple[list[int], int]:
        p = self.enc._ids(prompt_text)
        full = self.enc._ids(prompt_text + completion_text)
        shared = next((i for i, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), min(len(p), len(full)))
        return full + ([self.eos] if eos and self.eos is not None else []), shared

    def pair(self, values: tuple, where: str, key: str) -> list[tuple[list[int], int]]:
        if len(values) == 4:  # data.margin_field
            margin = values[3]
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
                raise InputError(
                    f"{key}: the margin of the record at {where} is {margin!r}, not a number: fix the record "
                    f"(or set data.margin_field to the field that holds the margins)"
                )
            self.margins.append(float(margin))
            values = values[:3]
        prompt, chosen, rejected = values
        if all(isinstance(v, str) for v in values):
            rows = [self._row(prompt, c, eos=True) for c in (chosen, rejected)]
        elif all(isinstance(v, list) for v in values):
            rows = [self._chat_row(prompt, c, where, key) for c in (chosen, rejected)]
        else:
            kinds = ", ".join(type(v).__name__ for v in values)
            raise InputError(
                f"{key}: record at {where} mixes field types ({kinds}): prompt, chosen and rejected must all be "
                f"text or all be lists of chat messages (fix the record)"
            )
        for (ids, p), name in zip(rows, ("chosen", "rejected"), strict=True):
            if len(ids) <= p:
                raise InputError(f"{key}: the {name} completion at {where} is empty: fix or drop the record")
        return rows

    def _chat_row(self, prompt: list, completion: list, where: str, key: str) -> tuple[list[int], int]:
        hf = self.enc._hf
        if not hf.chat_template:
            raise InputError(
                f"{key}: the record at {where} holds chat messages but the tokenizer has no chat template: set "
                f"data.chat_template (chatml, llama3, qwen, mistral or a Jinja file)"
            )
        self.enc.chat(prompt + completion, where, key)  # the message checks (roles, {role, content})
        prompt_text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) if prompt else ""
        full_text = hf.apply_chat_template(prompt + completion, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise InputError(
                f"{key}: the chat template does not render the prompt at {where} as the start of prompt + "
                f"completion; preference data needs a template that does (set data.chat_template)"
            )
        return self._row(prompt_text, full_text[len(prompt_text) :], eos=False)


def write_pairs(out: Path, rows: Iterable[tuple[list[int], int]], vocab_size: int, eos_id: Any, extra: dict) -> dict:
    """Shards of row tokens + rows.npy + meta.json (with the manifest) in `out`."""
    writer = ShardWriter(out, token_dtype(vocab_size), 50_000_000)
    lengths = []
    for ids, prompt_len in rows:
        writer.add(np.asarray(ids, dtype=writer.dtype))
        lengths.append((prompt_len, len(ids)))
    if not lengths:
        raise InputError(f"{extra.get('label', 'data.path')}: no preference pairs in the source: give it some records")
    writer.close({})
    for s in writer.shards:
        s["crc32"] = _crc32(out / s["file"])
    np.save(out / ROWS_FILE, np.asarray(lengths, dtype=np.int64))
    meta = {"vocab_size": vocab_size, "eos_id": eos_id, "pairs": len(lengths) // 2, **extra}
    return writer.close(meta)


def cached_pairs(
    files: list[Path],
    records: Iterable[tuple[tuple, str]],
    encoder: PairEncoder,
    tok: Any,
    options: dict,
    cache_dir: str,
    key: str,
) -> Path:
    """The cache entry of these records (built now unless a complete one exists)."""

    def build(tmp: Path) -> None:
        rows = (row for values, where in records for row in encoder.pair(values, where, key))
        write_pairs(tmp, rows, tok.vocab_size, tok.eos_id, {"tokenizer": tok.name, "source": options})
        if encoder.margins:
            np.save(tmp / MARGINS_FILE, np.asarray(encoder.margins, dtype=np.float64))

    return built_entry(cache_dir, files, tok, options, build, _complete)


def _complete(entry: Path) -> bool:
    return verify_entry(entry) is not None and (entry / ROWS_FILE).is_file()


def cut(prompt_len: int, length: int, limit: int) -> tuple[int, int]:
    """(first token kept, tokens kept) of a row cut to `limit` tokens: the prompt loses its start first,
    keeping at least min(prompt, limit // 2) of its last tokens; the completion then loses its end."""
    if length <= limit:
        return 0, length
    completion = length - prompt_len
    keep_prompt = max(limit - completion, min(prompt_len, limit // 2))
    return prompt_len - keep_prompt, limit


class PairSource:
    """Sample i = pair i: (2, 2, seq_len + 1) int64, [chosen, rejected] x [ids, completion mask] (a mask
    value of 1 at position t: token t is a completion token). Rows are right-padded with EOS (mask 0)."""

    def __init__(self, path: str, seq_len: int, key: str) -> None:
        self.shards = open_shards(path, key)
        lengths = np.load(Path(path) / ROWS_FILE)
        self.starts = np.concatenate([[0], np.cumsum(lengths[:, 1])[:-1]])
        self.lengths = lengths
        self.length = seq_len + 1
        self.pad = int(self.shards.meta.get("eos_id") or 0)
        self.num_samples: Optional[int] = len(lengths) // 2
        margins = Path(path) / MARGINS_FILE
        self.margins: Optional[np.ndarray] = np.load(margins) if margins.is_file() else None

    def margin(self, index: int) -> float:
        """Pair `index`'s margin (data.margin_field; entries without margins.npy have none)."""
        assert self.margins is not None
        return float(self.margins[index])

    def cut_pairs(self) -> int:
        """Pairs with at least one row longer than seq_len + 1 tokens (reported by the launcher)."""
        long = (self.lengths[:, 1] > self.length).reshape(-1, 2)
        return int(long.any(axis=1).sum())

    def sample(self, index: int) -> np.ndarray:
        out = np.zeros((2, 2, self.length), dtype=np.int64)
        out[:, 0] = self.pad
        for side in range(2):
            row = 2 * index + side
            prompt_len, length = (int(v) for v in self.lengths[row])
            skip, n = cut(prompt_len, length, self.length)
            out[side, 0, :n] = self.shards.window(int(self.starts[row]) + skip, n)
            out[side, 1, max(0, prompt_len - skip) : n] = 1
        return out


class SyntheticPairs:
    """data.kind=synthetic under a preference objective (benchmarks, plans): pair i drawn from (seed, i),
    uniform random ids; a shared prompt of half the row, then each side's completion to the row's end."""

    num_samples: Optional[int] = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int, tag: int) -> None:
        self.vocab_size, self.length, self.seed, self.tag = vocab_size, seq_len + 1, seed, tag

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.tag, index])
        out = np.zeros((2, 2, self.length), dtype=np.int64)
        prompt = self.length // 2
        out[:, 0] = rng.integers(0, self.vocab_size, (2, self.length))
        out[1, 0, :prompt] = out[0, 0, :prompt]
        out[:, 1, prompt:] = 1
        return out
