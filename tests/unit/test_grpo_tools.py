"""objective.tools' loading and its tool runner (dtlaunch.inputs.tools): schemas from type hints and
docstrings, and calls whose failures (an exception, an unknown name, a timeout, a crashed process) come
back to the model as TRL's `{"error": ...}` text while the next call still runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtlaunch.errors import InputError
from dtlaunch.inputs.tools import ToolRunner, load_tools

pytest.importorskip("transformers")

TOOLS = '''
import os
import sys
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    print("noise on stdout")  # must not garble the runner's replies
    return a + b


def boom(x: int) -> int:
    """Raise.

    Args:
        x: Anything.
    """
    raise ValueError(f"boom {x}")


def sleep(s: float) -> str:
    """Sleep.

    Args:
        s: Seconds.
    """
    time.sleep(s)
    return "awake"


def die(code: int) -> str:
    """End the process.

    Args:
        code: Its exit code.
    """
    os._exit(code)
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> list:
    f = tmp_path_factory.mktemp("tools") / "my_tools.py"
    f.write_text(TOOLS)
    return load_tools([f"{f}:{n}" for n in ("add", "boom", "sleep", "die")])


def test_schema_from_hints_and_docstring(tools) -> None:
    add = tools[0]
    assert add.name == "add" and add.schema["type"] == "function"
    assert add.schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first."}


def test_child_process_calls_and_failures(tools) -> None:
    runner = ToolRunner(tools, timeout_s=1.0)
    try:
        assert runner.call("add", {"a": 2, "b": 3}) == ("5", False)
        assert runner.call("boom", {"x": 1}) == ("{'error': 'boom 1'}", True)
        assert runner.call("nope", {}) == ("{'error': 'Tool nope not found.'}", True)
        text, failed = runner.call("add", {"a": 1})
        assert failed and "missing 1 required positional argument" in text
        first = runner.proc
        assert runner.call("sleep", {"s": 30}) == ("{'error': 'sleep: timed out after 1 s'}", True)
        assert runner.proc is None and first.returncode is not None  # killed
        assert runner.call("die", {"code": 3}) == ("{'error': 'die: the tool process exited (3)'}", True)
        assert runner.call("add", {"a": 1, "b": 1}) == ("2", False)  # a fresh process
    finally:
        runner.close()


def test_in_process_calls(tools) -> None:
    runner = ToolRunner(tools, timeout_s=0)
    assert runner.call("add", {"a": 2, "b": 3}) == ("5", False) and runner.proc is None
    assert runner.call("boom", {"x": 2}) == ("{'error': 'boom 2'}", True)


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(x):\n    return x\n", "has no JSON schema"),
        ("def f(x: int) -> int:\n    return x\n", "has no JSON schema"),
        ("f = 3\n", "has no function f"),
    ],
)
def test_bad_tools_refused(tmp_path: Path, source: str, message: str) -> None:
    f = tmp_path / "t.py"
    f.write_text(source)
    with pytest.raises(InputError) as err:
        load_tools([f"{f}:f"])
    assert message in str(err.value) and str(err.value).startswith("objective.tools: ") and "\n" not in str(err.value)


def test_two_tools_of_one_name_refused(tmp_path: Path, tools) -> None:
    (tmp_path / "other").mkdir()
    f = tmp_path / "other" / "my_tools.py"
    f.write_text(TOOLS)
    with pytest.raises(InputError, match="are both called add"):
        load_tools([tools[0].spec, f"{f}:add"])


@pytest.mark.parametrize(
    "template, refusal",
    [
        ("qwen2_5", None),
        ("qwen3_training", None),
        ("qwen3", "renders an assistant turn differently once tool messages follow it"),  # not prefix-preserving
        ("llama3_1", "writes tool calls in a format dtlaunch cannot parse"),
    ],
)
def test_chat_templates_for_tools(tmp_path: Path, template: str, refusal) -> None:
    """The launcher's template check (TRL's own copies of the models' templates)."""
    trl = pytest.importorskip("trl")
    from grpo_toy import write_byte_tokenizer

    from dtlaunch.data.prompts import PromptEncoder, tool_chat

    text = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    encoder = PromptEncoder(write_byte_tokenizer(tmp_path, text), "", [])
    if refusal is None:
        tool_chat(encoder, encoder.stop_ids(None))
        return
    with pytest.raises(InputError, match=refusal):
        tool_chat(encoder, encoder.stop_ids(None))
