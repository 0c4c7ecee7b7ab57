"""The built-in reward functions (accuracy, format) and the reward-call checks, with TRL's signature."""

from __future__ import annotations

import math

import pytest

from dtlaunch.errors import InputError
from dtlaunch.inputs.builtin_rewards import HAS_MATH_VERIFY, accuracy_reward, format_reward
from dtlaunch.inputs.rewards import Reward, call_reward


@pytest.mark.skipif(HAS_MATH_VERIFY, reason="math-verify decides instead of the built-in comparison")
def test_accuracy_reads_the_boxed_or_last_number() -> None:
    completions = [
        "so it is \\boxed{42}.",
        "first 41, then 42",
        "42 or maybe 43",
        [{"role": "assistant", "content": "the answer: 1,000"}],
        "no number",
        "\\boxed{\\frac{1}{2}}",
    ]
    golds = ["42", "42", "42", "1000", "7", "\\frac{1}{2}"]
    got = accuracy_reward(prompts=[""] * 6, completions=completions, completion_ids=[[]] * 6, answer=golds)
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # A record without an answer is "not applicable" (None), as TRL's reward functions say it.
    assert accuracy_reward(prompts=[""], completions=["1"], completion_ids=[[]], answer=[None]) == [None]


def test_format_matches_the_whole_completion() -> None:
    rx = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completions = [
        "<think>a\nb</think> <answer>3</answer>",
        "<answer>3</answer>",
        "<think>x</think><answer>3</answer>!",
    ]
    assert format_reward(prompts=[""] * 3, completions=completions, completion_ids=[[]] * 3, pattern=rx) == [
        1.0,
        0.0,
        0.0,
    ]


def test_call_reward_keeps_none_as_nan_and_refuses_bools() -> None:
    ok = Reward("half", lambda completions, **kw: [0.5, None], 1.0)
    values = call_reward(ok, ["p", "p"], ["a", "b"], [[1], [2]], {})
    assert values[0] == 0.5 and math.isnan(values[1])
    bad = Reward("flag", lambda completions, **kw: [True, False], 1.0)
    with pytest.raises(InputError, match="reward function 'flag' returned True"):
        call_reward(bad, ["p", "p"], ["a", "b"], [[1], [2]], {}, "r.jsonl:3")
