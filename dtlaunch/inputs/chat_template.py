"""A chat template (data.chat_template's file, or a tokenizer_config.json's chat_template), compiled in
the same Jinja sandbox transformers renders it with and rendered once with a sample conversation at
validate time. A template is user code: whatever it raises while compiling or rendering (a syntax
error, a blocked attribute, a range too large, a type error) is its author's to fix, so it becomes one
line naming the file, the template line and Jinja's reason."""

from __future__ import annotations

import re
from pathlib import Path
from types import TracebackType
from typing import Optional

from dtlaunch.errors import InputError
from dtlaunch.inputs.json_file import read_json_object

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


# transformers writes a tokenizer's template to this file since 4.50 (save_pretrained); it takes priority
# over tokenizer_config.json's chat_template when both exist, as in AutoTokenizer.from_pretrained.
TEMPLATE_FILE = "chat_template.jinja"
# `{% generation %}` ... `{% endgeneration %}` marks the assistant text to train
# (transformers' return_assistant_tokens_mask, TRL's assistant_only_loss).
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def own_chat_template(tokenizer_dir: Path) -> tuple[str, Path]:
    """(template, the file it came from) of a tokenizer directory: chat_template.jinja, else
    tokenizer_config.json's chat_template (named templates: the default one); ("", that file) when none."""
    jinja = tokenizer_dir / TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), jinja
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"'{jinja}' cannot be read ({exc}): restore the model's chat template") from None
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = read_json_object(config_file, f"'{config_file}'") if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return (template if isinstance(template, str) else ""), config_file


def has_generation_blocks(template: str) -> bool:
    return bool(_GENERATION_BLOCK.search(template))
