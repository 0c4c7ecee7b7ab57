"""Tools named in objective.tools (objective=grpo): Python functions the model may call while it generates,
as TRL's GRPOTrainer(tools=[...]) takes them. A name is `module:function` (imported from sys.path) or
`path/to/file.py:function`, loaded like a reward function (dtlaunch.inputs.rewards.import_function).

Each function's JSON schema comes from its type hints and its docstring (transformers' get_json_schema, the
schema apply_chat_template renders into the prompt): every argument needs a type hint and an `Args:` line.
`check_tools` imports every tool and builds its schema before any worker starts.

A call runs with the arguments the model wrote (`fn(**arguments)`); its result reaches the model as the text
`str(result)`. A call that raises, names no tool, or (in a child process) times out or kills its process,
returns `{"error": "..."}` to the model instead, as TRL does, and counts as a failure. With
objective.tool_timeout_s > 0 the calls run in one child process (`python -m dtlaunch.inputs.tools`, which
imports the tools again): a call still running after the timeout, or one that ends the process, has the
process killed and replaced. With 0 they run in the worker itself, without a timeout.

The module imports no torch: the child process starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dtlaunch.errors import InputError
from dtlaunch.inputs.rewards import import_function

KEY = "objective.tools"
READY = b"ready"
STARTUP_S = 120.0  # the child's start (an interpreter, the tools' imports) is not the call's time


@dataclass(frozen=True)
class Tool:
    name: str  # the function's name: what the model calls it by
    spec: str  # as objective.tools names it
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {...}}, as apply_chat_template takes it


def load_tool(spec: str) -> Tool:
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise InputError(f"{KEY}: '{spec}' is no tool: use module:function or path/to/file.py:function")
    fn = import_function(spec, KEY)
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise InputError(f"{KEY} needs transformers (its get_json_schema): pip install 'dtlaunch[hf]'") from None
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # TypeHintParsingException, DocstringParsingException: the user's function's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{KEY}: '{spec}' has no JSON schema ({first}): give every argument a type hint and a docstring with "
            f"a description and an `Args:` line per argument"
        ) from None
    return Tool(str(schema["function"]["name"]), spec, fn, schema)


def load_tools(specs: Sequence[str]) -> list[Tool]:
    tools = [load_tool(str(s)) for s in specs]
    seen: dict[str, str] = {}
    for t in tools:
        if t.name in seen:
            raise InputError(
                f"{KEY}: '{seen[t.name]}' and '{t.spec}' are both called {t.name}: the model calls tools by "
                f"name, so rename one"
            )
        seen[t.name] = t.spec
    return tools


def check_tools(o: Any) -> list[Tool]:
    """objective.tools imported and their schemas built (before any worker starts)."""
    return load_tools([str(s) for s in o.tools])


def call_in_process(tools: dict[str, Callable[..., Any]], name: str, arguments: Any) -> tuple[str, bool]:
    """(the result's text, whether the call failed): TRL's semantics for one function call."""
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return str(tools[name](**arguments)), False
    except Exception as exc:  # noqa: BLE001 - the user's tool: whatever it raises goes back to the model
        return str({"error": str(exc)}), True


class ToolRunner:
    """Runs tool calls: in a child process with a per-call timeout (timeout_s > 0), else in this process."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float) -> None:
        self.tools = {t.name: t.fn for t in tools}
        self.specs = [t.spec for t in tools]
        self.timeout_s = float(timeout_s)
        self.proc: Optional[subprocess.Popen] = None
        self._buffer = b""

    def call(self, name: str, arguments: Any) -> tuple[str, bool]:
        if self.timeout_s <= 0:
            return call_in_process(self.tools, name, arguments)
        if name not in self.tools:  # as TRL: no process needed to say so
            return str({"error": f"Tool {name} not found."}), True
        try:
            request = json.dumps({"name": name, "arguments": arguments}) + "\n"
        except (TypeError, ValueError) as exc:
            return str({"error": f"arguments are not JSON: {exc}"}), True
        proc = self._process()
        if proc is None:
            return str({"error": f"{name}: the tool process did not start"}), True
        try:
            assert proc.stdin is not None
            proc.stdin.write(request.encode())
            proc.stdin.flush()
            line = self._read_line(proc, time.monotonic() + self.timeout_s)
        except OSError:  # BrokenPipeError: the process is gone
            line = b""
        if not line:  # timed out (None), or the process ended (a crash, os._exit, a signal)
            code = self._ended(proc) if line is not None else None
            self.close()
            why = f"timed out after {self.timeout_s:g} s" if code is None else f"the tool process exited ({code})"
            return str({"error": f"{name}: {why}"}), True
        reply = json.loads(line)
        return str(reply["result"]), bool(reply["failed"])

    def _process(self) -> Optional[subprocess.Popen]:
        """The child, started (and its tools imported: a READY line) before any call's time counts."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtlaunch.inputs.tools", *self.specs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""
        if self._read_line(self.proc, time.monotonic() + max(STARTUP_S, self.timeout_s)) != READY:
            self.close()
            return None
        return self.proc

    @staticmethod
    def _ended(proc: subprocess.Popen) -> Optional[int]:
        """The exit code of a process whose stdout closed (it may take a moment to be reaped)."""
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> Optional[bytes]:
        """The next line; None past the deadline, b"" when the process closed its end."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self.proc = None


def _serve(specs: list[str]) -> None:
    """The child process: one JSON request per line on stdin, one reply per line on the original stdout.
    Whatever the tools print goes to stderr, so it never garbles a reply."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # The functions alone: their schemas (transformers) were built and checked by the worker.
    tools = {}
    for spec in specs:
        fn = import_function(spec, KEY)
        tools[getattr(fn, "__name__", spec.rpartition(":")[2])] = fn
    out.write(READY.decode() + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        result, failed = call_in_process(tools, request["name"], request["arguments"])
        out.write(json.dumps({"result": result, "failed": failed}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
