"""The built-in reward functions (objective.rewards: accuracy, format), with TRL's reward signature.

accuracy: 1.0 when the completion's answer equals the record's answer column, else 0.0; None for a
record without one. The completion's answer is its last \\boxed{...}, else its last number; the gold is
the column's last \\boxed{...}, else the whole column. Numbers compare as numbers (1.50 == 1.5), anything
else as stripped text. With the optional `math-verify` package installed (pip install 'dtlaunch[rl]'), its
parser and verifier decide instead (LaTeX, fractions, sets).
format: 1.0 when the whole completion matches objective.format_regex (re.DOTALL), else 0.0.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Optional

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def completion_text(completion: Any) -> str:
    """A completion as text: the string itself, or the content of a conversational completion's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def extract_answer(text: str) -> Optional[str]:
    """The last \\boxed{...} content, else the last number, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(answer: str, gold: str) -> bool:
    a, g = answer.replace(",", "").strip(), gold.replace(",", "").strip()
    try:
        return float(a) == float(g)
    except ValueError:
        return a == g


def _verified(text: str, gold: str) -> bool:
    import math_verify

    return bool(math_verify.verify(math_verify.parse(gold), math_verify.parse(text)))


def accuracy_reward(
    prompts: list, completions: list, completion_ids: list, answer_field: str = "answer", **columns: Any
) -> list[Optional[float]]:
    golds = columns.get(answer_field)
    if golds is None:
        raise KeyError(f"the accuracy reward compares with the dataset column '{answer_field}', which is missing")
    out: list[Optional[float]] = []
    for completion, gold in zip(completions, golds, strict=True):
        if gold is None:
            out.append(None)
            continue
        text, gold_s = completion_text(completion), str(gold)
        if HAS_MATH_VERIFY:
            out.append(1.0 if _verified(text, gold_s) else 0.0)
            continue
        answer = extract_answer(text)
        boxed = _BOXED.findall(gold_s)  # a gold column may hold a worked solution ending in \boxed{...}
        gold_answer = boxed[-1].strip() if boxed else gold_s.strip()
        out.append(1.0 if answer is not None and _same(answer, gold_answer) else 0.0)
    return out


def format_reward(
    prompts: list, completions: list, completion_ids: list, pattern: str = "", **columns: Any
) -> list[float]:
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.fullmatch(completion_text(c)) else 0.0 for c in completions]
