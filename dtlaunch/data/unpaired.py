"""Unpaired preference examples (data.format=unpaired, objective=kto): {prompt, completion, label} records
-> token rows, cached; TRL's unpaired preference format, as its KTOTrainer prepares it.

A record's prompt and completion are text, or lists of chat messages, encoded as a preference pair's
(dtlaunch.data.preference.PairEncoder: an EOS ends a text completion); its label is a JSON boolean, true
for a desirable completion. Each example is stored as two rows, as a pair is (so the pair machinery carries
it whole: the loader's stacking, the reference, its precomputed table, the planner's two rows a sample):
its own prompt + completion, and its KL row: its prompt + the completion of the previous record of its run
of training.micro_batch records in file order (the first takes the run's last), TRL's `KL_completion_ids`
(a batched map of per_device_train_batch_size over the dataset: completions rotated by one). labels.npy
holds the labels. The worker's UnpairedSource is a PairSource (rows cut as a pair's) that hands the labels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dtlaunch.data.cache import built_entry, verify_entry
from dtlaunch.data.preference import ROWS_FILE, PairEncoder, PairSource, SyntheticPairs, write_pairs
from dtlaunch.errors import InputError

LABELS_FILE = "labels.npy"


def encode_example(encoder: PairEncoder, values: tuple, where: str, key: str) -> tuple[list[int], int, bool]:
    """(prompt + completion ids, prompt length, label) of one record."""
    prompt, completion, label = values
    if not isinstance(label, bool):
        raise InputError(
            f"{key}: the label at {where} is {label!r}, not true / false: give each record a boolean label "
            f"(data.label_field names it)"
        )
    if isinstance(prompt, str) and isinstance(completion, str):
        ids, p = encoder._row(prompt, completion, eos=True)
    elif isinstance(prompt, list) and isinstance(completion, list):
        ids, p = encoder._chat_row(prompt, completion, where, key)
    else:
        kinds = f"{type(prompt).__name__}, {type(completion).__name__}"
        raise InputError(
            f"{key}: record at {where} mixes field types ({kinds}): prompt and completion must both be text or "
            f"both be lists of chat messages (fix the record)"
        )
    if len(ids) <= p:
        raise InputError(f"{key}: the completion at {where} is empty: fix or drop the record")
    return ids, p, label


def example_rows(examples: Iterable[tuple[list[int], int, bool]], run: int, labels: list) -> Iterator[tuple]:
    """Each example's own row, then its KL row (see the module docstring); appends the labels to `labels`."""
    buf: list[tuple[list[int], int, bool]] = []

    def flush() -> Iterator[tuple]:
        for i, (ids, p, label) in enumerate(buf):
            prev_ids, prev_p, _ = buf[i - 1]  # i = 0: the run's last
            labels.append(label)
            yield ids, p
            yield ids[:p] + prev_ids[prev_p:], p
        buf.clear()

    for ex in examples:
        buf.append(ex)
        if len(buf) == run:
            yield from flush()
    yield from flush()


def cached_examples(
    files: list[Path],
    records: Iterable[tuple[tuple, str]],
    encoder: PairEncoder,
    tok: Any,
    options: dict,
    cache_dir: str,
    key: str,
    run: int,
) -> Path:
    """The cache entry of these records (built now unless a complete one exists); `run`: training.micro_batch,
    the KL rows' run length (part of `options`, so of the key)."""

    def build(tmp: Path) -> None:
        labels: list[bool] = []
        examples = (encode_example(encoder, values, where, key) for values, where in records)
        write_pairs(tmp, example_rows(examples, run, labels), tok.vocab_size, tok.eos_id, {"source": options})
        np.save(tmp / LABELS_FILE, np.asarray(labels, dtype=bool))

    return built_entry(cache_dir, files, tok, options, build, _complete)


def _complete(entry: Path) -> bool:
    return verify_entry(entry) is not None and (entry / ROWS_FILE).is_file() and (entry / LABELS_FILE).is_file()


class UnpairedSource(PairSource):
    """Sample i = example i: (2, 2, seq_len + 1), [own row, KL row] x [ids, completion mask]; `labels`."""

    def __init__(self, path: str, seq_len: int, key: str) -> None:
        super().__init__(path, seq_len, key)
        self._labels = np.load(Path(path) / LABELS_FILE)

    def labels(self, indices: list[int]) -> np.ndarray:
        return self._labels[np.asarray(indices, dtype=np.int64)]


class SyntheticExamples(SyntheticPairs):
    """data.kind=synthetic under objective=kto (benchmarks, plans): SyntheticPairs' rows, the second one the
    KL row; even examples desirable, odd ones not."""

    def labels(self, indices: list[int]) -> np.ndarray:
        return np.asarray(indices, dtype=np.int64) % 2 == 0
