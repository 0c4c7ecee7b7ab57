"""Document readers for structured sources: JSONL (stdlib), Parquet (pyarrow), Hugging Face datasets.

Each reader streams: it yields one document's text at a time (JSONL line by line, Parquet in record
batches of one column, datasets through its Arrow-backed iterator), so a corpus larger than memory
costs only what the tokenizer holds in flight. The libraries are imported here, on these paths only.
Files are read in sorted order, so the same inputs always give the same document order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from dtlaunch.data.prepare import resolve_inputs
from dtlaunch.errors import ConfigError, InputError

# File pattern used inside a directory given as data.path, by kind.
DIR_PATTERNS = {"jsonl": "**/*.jsonl", "parquet": "**/*.parquet"}
# datasets' packaged builder for local data files, by extension.
_HF_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}
EXTRA_HINT = "pip install 'dtlaunch[data]'"
# What to set to name another field, as the caller's user spells it (`data prepare`: --text-field).
FIELD_KEY = "data.text_field (or the format's field option)"


def _need(module: str, kind: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"data.kind={kind} needs the '{module.split('.')[0]}' package: {EXTRA_HINT}") from exc


def _keys_hint(record: Any) -> str:
    if isinstance(record, dict):
        return f"its keys are {sorted(record)[:12]}"
    return f"it is a JSON {type(record).__name__}, not an object"


def _fields_of(record: Any, fields: Sequence[str], where: str, key: str, field_key: str) -> tuple:
    if not isinstance(record, dict) or any(f not in record for f in fields):
        missing = next(f for f in fields if not isinstance(record, dict) or f not in record)
        raise InputError(
            f"{key}: record at {where} has no field '{missing}' ({_keys_hint(record)}): set {field_key} to one of them"
        )
    return tuple(record[f] for f in fields)


def iter_jsonl(
    files: Sequence[Path], fields: Sequence[str], key: str = "data.path", field_key: str = FIELD_KEY
) -> Iterator[tuple[tuple, str]]:
    for f in files:
        try:
            fh = f.open("rb")
        except OSError as exc:
            raise InputError(f"{key}: cannot read '{f}': {exc.strerror}") from exc
        with fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise InputError(
                        f"{key}: {f}:{n} is not JSON ({str(exc).splitlines()[0]}): each line of a .jsonl file must "
                        f"be one JSON object"
                    ) from exc
                yield _fields_of(record, fields, f"{f}:{n}", key, field_key), f"{f}:{n}"


def iter_parquet(
    files: Sequence[Path], fields: Sequence[str], key: str = "data.path", field_key: str = FIELD_KEY
) -> Iterator[tuple[tuple, str]]:
    pq = _need("pyarrow.parquet", "parquet")
    for f in files:
        try:
            pf = pq.ParquetFile(str(f))
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for non-Parquet files
            raise InputError(f"{key}: '{f}' is not a readable Parquet file ({str(exc).splitlines()[0]})") from exc
        names = pf.schema_arrow.names
        for field in fields:
            if field not in names:
                raise InputError(
                    f"{key}: Parquet file '{f}' has no column '{field}' (its columns are {names[:12]}): "
                    f"set {field_key} to one of them"
                )
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=list(fields)):
            for values in zip(*(batch.column(i).to_pylist() for i in range(len(fields))), strict=True):
                row += 1
                yield values, f"{f} row {row}"


def is_saved_dataset(path: Path) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def load_hf(path: str, split: str, key: str, subset: Optional[str] = None) -> Any:
    # Never reach the hub: set before `datasets` is imported (it reads these at import time).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = _need("datasets", "hf")
    p = Path(path).expanduser()
    if subset is not None:
        return _load_snapshot(datasets, p, subset, split, key)
    if is_saved_dataset(p):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise InputError(
                    f"{key}: the dataset at '{path}' has no split '{split}' (it has {sorted(ds)}): set data.split"
                )
            ds = ds[split]
        return ds
    files = hf_data_files(path, key)
    exts = {f.suffix for f in files}
    builder = _HF_BUILDERS.get(files[0].suffix) if len(exts) == 1 else None
    if builder is None:
        raise InputError(
            f"{key}: '{path}' is neither a save_to_disk dataset nor data files of one type "
            f"({', '.join(sorted(_HF_BUILDERS))}): point data.path at one of those"
        )
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split)
    except Exception as exc:  # datasets wraps parse errors in its own exception types
        raise InputError(f"{key}: datasets cannot read '{path}': {str(exc).splitlines()[0]}") from exc


def _load_snapshot(datasets: Any, p: Path, subset: str, split: str, key: str) -> Any:
    """A hub dataset's snapshot directory, read by datasets' own rules for a repository (its README's
    configurations, split names from file names), so data.subset and data.split mean what they do on the hub."""
    try:
        return datasets.load_dataset(str(p), name=subset or None, split=split)
    except ValueError as exc:  # an unknown configuration or split
        raise InputError(f"{key}: {str(exc).splitlines()[0]}: set data.subset / data.split to one it has") from None
    except Exception as exc:  # datasets wraps parse errors in its own exception types
        raise InputError(f"{key}: datasets cannot read the hub snapshot: {str(exc).splitlines()[0]}") from exc


def hf_data_files(path: str, key: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in _HF_BUILDERS]
        if not files:
            raise InputError(f"{key}: directory '{path}' holds no dataset (no save_to_disk files, no data files)")
        return files
    return resolve_inputs([path], "**/*", key)


def iter_hf(
    path: str,
    fields: Sequence[str],
    split: str,
    key: str = "data.path",
    subset: Optional[str] = None,
    field_key: str = FIELD_KEY,
) -> Iterator[tuple[tuple, str]]:
    ds = load_hf(path, split, key, subset)
    names = list(ds.column_names)
    for field in fields:
        if field not in names:
            raise InputError(
                f"{key}: the dataset at '{path}' has no column '{field}' (its columns are {names[:12]}): "
                f"set {field_key} to one of them"
            )
    row = 0
    for batch in ds.select_columns(list(fields)).iter(batch_size=1024):
        for values in zip(*(batch[f] for f in fields), strict=True):
            row += 1
            yield values, f"{path} row {row}"


def source_files(kind: str, path: str, key: str = "data.path") -> list[Path]:
    """The files whose identity keys the token cache (a save_to_disk directory: its Arrow files)."""
    if kind == "hf":
        p = Path(path).expanduser()
        if is_saved_dataset(p):
            return sorted(f for f in p.rglob("*") if f.is_file())
        return hf_data_files(path, key)
    return resolve_inputs([path], DIR_PATTERNS[kind], key)


def iter_records(
    kind: str,
    path: str,
    fields: Sequence[str],
    split: str = "train",
    key: str = "data.path",
    subset: Optional[str] = None,
    field_key: str = FIELD_KEY,
) -> Iterator[tuple[tuple, str]]:
    """(values of `fields`, where) for every record of a jsonl / parquet / hf source, in a fixed order.
    `subset` is not None for a hub dataset's snapshot (its configuration name, "" for the default);
    `field_key` is what an error tells the user to set to name another field."""
    if kind == "jsonl":
        return iter_jsonl(source_files(kind, path, key), fields, key, field_key)
    if kind == "parquet":
        return iter_parquet(source_files(kind, path, key), fields, key, field_key)
    if kind == "hf":
        return iter_hf(path, fields, split, key, subset, field_key)
    raise ValueError(f"not a record kind: {kind}")


def iter_documents(
    kind: str,
    path: str,
    field: str,
    split: str = "train",
    key: str = "data.path",
    subset: Optional[str] = None,
    field_key: str = "data.text_field",
) -> Iterator[str]:
    """Every document's text (data.format=text); a null value is no document."""
    for (value,), where in iter_records(kind, path, [field], split, key, subset, field_key):
        if value is None:
            continue
        if not isinstance(value, str):
            raise InputError(
                f"{key}: field '{field}' at {where} is a {type(value).__name__}, not text: set {field_key} to "
                f"a text field"
            )
        yield value
