"""A safetensors file's header, read and checked by hand: 8 bytes of length, a JSON table of tensors,
then the data. Only the header is read; its offsets are checked against the file's size, so a file cut
short, padded, empty or with a garbage header is refused here (safetensors' own SafetensorError would
otherwise surface as an internal error far from the file's name)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from dtlaunch.errors import InputError

# Bytes per element of every dtype the format defines (safetensors' Dtype enum).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# safetensors refuses larger headers too (a garbage length must not make us read gigabytes).
MAX_HEADER_BYTES = 100_000_000


def read_header(file: Path, fix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file; InputError naming `file` and `fix` when the
    header is unreadable or does not describe the file's bytes exactly."""

    def bad(why: str) -> InputError:
        return InputError(f"'{file}' is not a valid safetensors file ({why}): {fix}")

    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"its header claims {n} bytes but the file has {size}: it is cut short or not safetensors")
            raw = fh.read(n)
    except OSError as exc:
        raise InputError(f"cannot read '{file}': {exc.strerror or exc}: {fix}") from None
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"its header is not JSON: {str(exc).splitlines()[0][:80]}") from None
    if not isinstance(table, dict):
        raise bad("its header is not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in table.items():
        if name == "__metadata__":
            if entry is not None and not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise bad("its __metadata__ is not a table of strings")
            continue
        if not isinstance(entry, dict):
            raise bad(f"entry {_show(name)} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise bad(f"tensor {_show(name)} has unknown dtype {_show(dtype, 20)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {_show(name)} has shape {_show(shape, 40)}, not a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise bad(f"tensor {_show(name)} has data_offsets {_show(offsets, 40)}, not [begin, end]")
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise bad(
                f"tensor {_show(name)} spans {end - begin} bytes, its shape {shape} and {dtype} need another size"
            )
        tensors[name] = (dtype, tuple(shape))
        spans.append((begin, end, name))
    # The data must be covered exactly, without holes or overlaps (what safetensors itself insists on).
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise bad(
                f"tensor {_show(name)} starts at byte {begin}, expected {at}: the offsets overlap or leave a hole"
            )
        at = end
    if at != size - 8 - n:
        raise bad(f"its tensors cover {at} bytes of data but the file holds {size - 8 - n}: it is cut short or padded")
    return tensors


def _show(x: object, n: int = 60) -> str:
    """A name or value from the file, quoted and escaped (no newline reaches the one-line message)."""
    return json.dumps(x, ensure_ascii=False, default=str)[:n]


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
