"""A chat template (data.chat_template's file, or a tokenizer_config.json's chat_template), compiled in
the same Jinja sandbox transformers renders it with and rendered once with a sample conversation at
validate time. A template is user code: whatever it raises while compiling or rendering (a syntax
error, a blocked attribute, a range too large, a type error) is its author's to fix, so it becomes one
line naming the file, the template line and Jinja's reason."""

from __future__ import annotations

from types import TracebackType
from typing import Optional

from dtlaunch.errors import InputError

SAMPLE = [
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A helpful assistant."},
]


def template_line(exc: BaseException) -> Optional[int]:
    """The template line an error came from: a syntax error carries it; a runtime error's traceback
    has frames whose file is the template ('<template>', as Jinja rewrites them)."""
    lineno = getattr(exc, "lineno", None)
    if isinstance(lineno, int):
        return lineno
    found = None
    tb: Optional[TracebackType] = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            found = tb.tb_lineno
        tb = tb.tb_next
    return found


def describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def check_chat_template(text: str, where: str, fix: str = "fix the template") -> None:
    """Compile and render `text` with a sample conversation; InputError '<where>, line N: ...' on failure."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return  # validate refuses data.format=chat without transformers, naming the extra
    try:
        render_jinja_template(conversations=[SAMPLE], chat_template=text, bos_token="", eos_token="")
    except Exception as exc:  # noqa: BLE001 - user code: any exception is the template's (see module doc)
        raise template_error(exc, where, fix) from None


def template_error(exc: BaseException, where: str, fix: str) -> InputError:
    line = template_line(exc)
    at = f"{where}, line {line}" if line else where
    return InputError(f"chat template {at}: {describe(exc)}: {fix}")
