"""A JSON file that must hold an object (adapter_config.json, tokenizer_config.json), read or refused in
one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

from dtlaunch.errors import InputError


def read_json_object(file: Path, where: str) -> dict:
    """The object in `file`; InputError starting with `where` when it is unreadable or not an object."""
    try:
        c = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{where} is not readable JSON ({str(exc)[:80]}): restore it") from None
    if not isinstance(c, dict):
        raise InputError(f"{where} holds a JSON {type(c).__name__}, not an object: restore it")
    return c
