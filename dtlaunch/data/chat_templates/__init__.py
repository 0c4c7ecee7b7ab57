"""Built-in chat templates (`data.chat_template=NAME`): Jinja files beside this module, rendered by
transformers' apply_chat_template exactly like a tokenizer's own chat_template.

Each format's control strings must be single tokens of the tokenizer it is used with: `<|im_start|>`
spelled out in pieces by a tokenizer that lacks it trains the model on a format it will never be
prompted with, so such a pairing is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Optional

from dtlaunch.errors import ConfigError

_DIR = Path(__file__).parent
# Built-in name -> the control strings its rendering contains, each of which must be one token.
BUILTIN: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
}


def chat_template_problem(spec: str, fmt: str) -> Optional[str]:
    """validate's rule for data.chat_template: a one-line refusal, or None."""
    if not spec:
        return None
    if fmt not in ("chat", "prompt"):
        return f"data.chat_template={spec} is used only with data.format=chat or prompt (it is {fmt}): drop it"
    if spec not in BUILTIN and not Path(spec).expanduser().is_file():
        return (
            f"data.chat_template='{spec}' is neither a built-in template ({', '.join(BUILTIN)}) nor an existing "
            f"Jinja file: fix the name or the path"
        )
    return None


def load_chat_template(spec: str) -> str:
    """The template text of a built-in name or a Jinja file."""
    path = _DIR / f"{spec}.jinja" if spec in BUILTIN else Path(spec).expanduser()
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"data.chat_template='{spec}' cannot be read ({exc}): give a readable Jinja file") from exc


def chosen_chat_template(spec: str, tokenizer_json: Path) -> tuple[str, str]:
    """The chat template a job renders with, and where it came from (for messages): data.chat_template (a
    built-in name or a Jinja file) when set, else the own template of the tokenizer `tokenizer_json`
    (chat_template.jinja or tokenizer_config.json beside it); ("", that place) when it has none."""
    if spec:
        where = f"data.chat_template={spec}" if spec in BUILTIN else f"'{Path(spec).expanduser()}'"
        return load_chat_template(spec), where
    from dtlaunch.inputs.chat_template import own_chat_template

    template, source = own_chat_template(Path(tokenizer_json).parent)
    return template, f"'{source}'" if source.suffix == ".jinja" else f"chat_template of '{source}'"


def template_identity(spec: str) -> str:
    """A hash of the template text (part of the token cache key: a changed template re-tokenizes)."""
    return hashlib.sha256(load_chat_template(spec).encode()).hexdigest()[:16] if spec else ""


def check_template_tokens(spec: str, has_token: Callable[[str], bool], tokenizer: str) -> None:
    """A built-in template's control strings must each be one token of the tokenizer."""
    missing = [t for t in BUILTIN.get(spec, ()) if not has_token(t)]
    if missing:
        raise ConfigError(
            f"data.chat_template={spec} writes '{missing[0]}', which tokenizer '{tokenizer}' does not have as one "
            f"token: use the template of the model's family (or a Jinja file of your own)"
        )
