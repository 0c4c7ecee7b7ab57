"""Spoiling a file the way disks, copies and people do, drawn by hypothesis: bytes (cut, emptied,
flipped, padded, replaced), JSON (a value made hostile, a key dropped, the text cut), a safetensors
header (its JSON mutated, its length lying), or the file gone or turned into a directory."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

from fuzz_harness import HOSTILE_TEXT
from hypothesis import strategies as st

HOSTILE_JSON: list[Any] = [
    -1,
    0,
    1,
    2,
    3,
    7,
    -(2**63),
    2**63,
    10**30,
    1.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    "",
    "abc",
    [],
    [1],
    ["q_proj"],
    {},
    {"a": 1},
    [[[[[]]]]],
    *HOSTILE_TEXT[:8],
]


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON tree (lists by index), the root excluded."""
    out = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:8]):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _set(tree: Any, path: tuple, value: Any, delete: bool = False) -> None:
    for p in path[:-1]:
        tree = tree[p]
    if delete:
        del tree[path[-1]]
    else:
        tree[path[-1]] = value


def mutate_json(data: st.DataObject, tree: Any) -> Any:
    """A copy of `tree` with one to three values made hostile, dropped or added."""
    tree = json.loads(json.dumps(tree))
    for _ in range(data.draw(st.integers(1, 3), label="json edits")):
        paths = _paths(tree)
        how = data.draw(st.sampled_from(["set", "set", "set", "drop", "add"]), label="json edit")
        if how == "add" or not paths:
            if isinstance(tree, dict):
                tree[data.draw(st.sampled_from(["r", "vocab_size", "extra", "chat_template", "x"]))] = data.draw(
                    st.sampled_from(HOSTILE_JSON)
                )
            continue
        path = data.draw(st.sampled_from(paths), label="json path")
        _set(tree, path, data.draw(st.sampled_from(HOSTILE_JSON), label="json value"), delete=how == "drop")
    return tree


def spoil_bytes(data: st.DataObject, f: Path) -> str:
    raw = f.read_bytes()
    how = data.draw(
        st.sampled_from(["cut", "empty", "flip", "pad", "insert", "random", "delete", "dir", "bom"]), label="bytes"
    )
    if how == "cut":
        f.write_bytes(raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut at")])
    elif how == "empty":
        f.write_bytes(b"")
    elif how in ("flip", "insert") and raw:
        # Spoils near the start hit headers and JSON syntax, where most structure is.
        i = data.draw(st.integers(0, min(len(raw) - 1, 400)) | st.integers(0, len(raw) - 1), label="at")
        b = data.draw(st.integers(0, 255), label="byte")
        f.write_bytes(
            raw[:i] + bytes([raw[i] ^ (b or 1)]) + raw[i + 1 :] if how == "flip" else raw[:i] + bytes([b]) + raw[i:]
        )
    elif how == "pad":
        f.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64), label="pad"))
    elif how == "random":
        f.write_bytes(data.draw(st.binary(max_size=200), label="random bytes"))
    elif how == "delete":
        f.unlink()
    elif how == "dir":
        f.unlink()
        f.mkdir()
    elif how == "bom":
        f.write_bytes(b"\xef\xbb\xbf" + raw)
    return f"{how} {f.name}"


def spoil_json(data: st.DataObject, f: Path) -> str:
    try:
        tree = json.loads(f.read_text())
    except (OSError, ValueError):
        return spoil_bytes(data, f)
    f.write_text(json.dumps(mutate_json(data, tree)))
    return f"json {f.name}"


def spoil_safetensors_header(data: st.DataObject, f: Path) -> str:
    raw = f.read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
    except (struct.error, ValueError):  # spoiled already: spoil it further as bytes
        return spoil_bytes(data, f)
    new = json.dumps(mutate_json(data, header)).encode()
    # The header's length either follows the new JSON or keeps (or makes up) a lie.
    length = data.draw(st.sampled_from([len(new), len(new), n, 0, 2**64 - 1, len(new) + 7]), label="length")
    f.write_bytes(struct.pack("<Q", length) + new + raw[8 + n :])
    return f"header {f.name}"


def spoil_file(data: st.DataObject, f: Path) -> str:
    """One spoil of `f`, chosen by its kind (any file can also be spoiled as bytes)."""
    if f.suffix == ".safetensors" and data.draw(st.booleans(), label="header?"):
        return spoil_safetensors_header(data, f)
    if f.suffix == ".json" and data.draw(st.booleans(), label="json?"):
        return spoil_json(data, f)
    return spoil_bytes(data, f)


def copy_and_spoil(data: st.DataObject, src: Path, dst: Path, candidates: list[str]) -> str:
    """Copy the directory `src` to `dst` and spoil one or two of its files named in `candidates`."""
    shutil.copytree(src, dst)
    notes = []
    for _ in range(data.draw(st.integers(1, 2), label="files spoiled")):
        present = [c for c in candidates if (dst / c).is_file()]
        if not present:
            break
        notes.append(spoil_file(data, dst / data.draw(st.sampled_from(present), label="file")))
    return "; ".join(notes)
