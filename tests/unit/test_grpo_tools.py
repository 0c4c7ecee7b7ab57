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


# objective.environment: the instances live in the runner's child process, addressed by id.
ENV = '''
import os
import time


class Room:
    def __init__(self):
        self.pid, self.items = os.getpid(), []

    def reset(self, **record):
        self.items = [record["start"]]
        return None if record["start"] == "quiet" else f" You hold {record['start']}."

    def take(self, item: str) -> str:
        """Take an item.

        Args:
            item: Its name.
        """
        self.items.append(item)
        return ",".join(self.items)

    def wait(self, s: float) -> str:
        """Wait.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return "waited"

    def where(self) -> int:
        """The process the instance lives in."""
        return self.pid

    def get_reward(self) -> float:
        if "poison" in self.items:
            raise RuntimeError("poisoned")
        return float(len(self.items))


class NoReset:
    def look(self) -> str:
        """Look."""
        return ""


class NoSchema:
    def reset(self, **record):
        return None

    def act(self, x):
        return x


class NoReward:
    def reset(self, **record):
        return None
'''


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("env") / "my_env.py"
    f.write_text(ENV)
    return f


def test_environment_instances_in_the_child_process(env_file, tools) -> None:
    import os

    from dtlaunch.inputs.tools import EnvironmentFailure, load_environment

    env = load_environment(f"{env_file}:Room")
    assert env.tool_names() == ["take", "wait", "where"] and env.has_reward  # not reset, get_reward, _private
    runner = ToolRunner(tools[:1], timeout_s=1.0, environments=[env])
    try:
        assert runner.reset("/0", "", {"start": "key"}) == " You hold key."
        assert runner.reset("/1", "", {"start": "quiet"}) is None
        assert runner.call("take", {"item": "map"}, instance="/0") == ("key,map", False)
        assert runner.call("take", {"item": "cup"}, instance="/1") == ("quiet,cup", False)  # its own state
        assert runner.call("add", {"a": 1, "b": 1}, instance="/1") == ("2", False)  # objective.tools beside
        assert runner.call("take", {"item": "x"}) == ("{'error': 'Tool take not found.'}", True)  # no instance
        pid = int(runner.call("where", {}, instance="/0")[0])
        assert pid == runner.proc.pid != os.getpid()  # the instance lives in the child
        assert runner.get_reward("/0") == 2.0 and runner.get_reward("/1") == 2.0
        assert runner.reset("/0", "", {"start": "pen"}) == " You hold pen."  # reset, not made again
        assert runner.call("where", {}, instance="/0") == (str(pid), False)
        # A call past the timeout kills the process and its instances: their calls fail, their reward is None.
        text, failed = runner.call("wait", {"s": 5}, instance="/0")
        assert failed and "timed out" in text
        assert runner.call("take", {"item": "y"}, instance="/1") == (
            "{'error': 'environment instance /1 was lost'}",
            True,
        )
        assert runner.get_reward("/1") is None
        assert runner.reset("/1", "", {"start": "poison"}) == " You hold poison."  # made again, new process
        with pytest.raises(EnvironmentFailure, match=r"Room.get_reward failed \(RuntimeError: poisoned\)"):
            runner.get_reward("/1")
        with pytest.raises(EnvironmentFailure, match=r"Room.reset failed \(KeyError"):
            runner.reset("/1", "", {})
    finally:
        runner.close()


def test_environment_refusals(env_file, tools) -> None:
    from omegaconf import OmegaConf

    from dtlaunch.inputs.tools import check_environments, load_environment

    with pytest.raises(InputError, match="has no callable `reset`"):
        load_environment(f"{env_file}:NoReset")
    with pytest.raises(InputError, match=r"NoSchema.act' has no JSON schema"):
        load_environment(f"{env_file}:NoSchema")
    with pytest.raises(InputError, match="cannot be imported|has no function"):
        load_environment(f"{env_file}:Nowhere")
    both = OmegaConf.create({"environment": f"{env_file}:Room", "environments": {"a": f"{env_file}:Room"}})
    with pytest.raises(InputError, match="are both set"):
        check_environments(both)
    clash = OmegaConf.create({"environment": "", "environments": {"a": f"{env_file}:Room"}})
    take = type(tools[0])(name="take", spec="t.py:take", fn=tools[0].fn, schema=tools[0].schema)
    with pytest.raises(InputError, match="has a method take, as the tool 't.py:take' is called"):
        check_environments(clash, [take])
    assert [e.key for e in check_environments(clash, tools)] == ["a"]


def test_environments_by_column(env_file) -> None:
    """objective.environments: each rollout's instance from its record's `environment` column (not passed to
    reset), counted per environment; one reward column per factory, None for the other environments' rows."""
    from omegaconf import OmegaConf

    from dtlaunch.inputs.tools import (
        check_environments,
        environment_keys,
        environment_reward_columns,
        environment_rewards,
        reset_prompts,
        rollout_instances,
    )

    room = f"{env_file}:Room"
    o = OmegaConf.create({"environment": "", "environments": {"a": room, "b": room}})
    envs = check_environments(o)
    columns = [{"environment": k, "start": s} for k, s in (("b", "x"), ("a", "quiet"), ("b", "environment"))]
    keys = environment_keys(envs, columns)
    instances = rollout_instances(keys)
    assert keys == ["b", "a", "b"] and instances == ["b/0", "a/0", "b/1"]
    runner = ToolRunner([], timeout_s=0, environments=envs)  # in this process
    prompts = [[{"role": "user", "content": "Go."}]] * 3
    out = reset_prompts(runner, keys, instances, prompts, columns)
    assert [m[-1]["content"] for m in out] == ["Go. You hold x.", "Go.", "Go. You hold environment."]
    assert runner.call("take", {"item": "y"}, instance="b/1") == ("environment,y", False)
    (owner,) = environment_reward_columns(envs)  # one factory under two names: one column
    assert environment_rewards(runner, owner, envs, keys, instances) == [1.0, 1.0, 2.0]
    other = type(owner)("c", "other.py:Room", owner.cls, owner.tools, True)
    assert environment_rewards(runner, other, [*envs, other], keys, instances) == [None, None, None]
    with pytest.raises(InputError, match="environment column is 'c'"):
        environment_keys(envs, [{"environment": "c"}])


def test_environment_as_the_only_reward(env_file) -> None:
    """TRL: no reward function is needed when the environment owns the reward; refused when none does."""
    from omegaconf import OmegaConf

    from dtlaunch.inputs.tools import check_environments

    def o(cls: str) -> object:
        return OmegaConf.create({"environment": f"{env_file}:{cls}", "environments": {}, "rewards": []})

    assert check_environments(o("Room"))[0].has_reward
    with pytest.raises(InputError, match="objective.rewards is empty and objective.environment: .*has no get_reward"):
        check_environments(o("NoReward"))


# Hostile user code (issue #51): whatever a tool, an environment or a reward function does in the runner's
# child process becomes an error for the model (tools) or one line (rewards); the process is replaced.
HOSTILE = '''
import ctypes
import os
import signal
import subprocess
import sys
import time


def hog(n: int) -> str:
    """Allocate without end.

    Args:
        n: Bytes per chunk.
    """
    chunks = []
    while True:
        chunks.append(bytearray(n))


def segv(x: int) -> str:
    """Crash in C.

    Args:
        x: Anything.
    """
    ctypes.string_at(0)


def kill9(x: int) -> str:
    """SIGKILL its own process.

    Args:
        x: Anything.
    """
    os.kill(os.getpid(), signal.SIGKILL)


def spawn_and_hang(marker: str) -> str:
    """Start a grandchild that would outlive the tool, then hang.

    Args:
        marker: In the grandchild's command line.
    """
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    time.sleep(600)


def score(prompts, completions, completion_ids, **kw):
    return [None if c == "skip" else float(len(c)) for c in completions]


def raising(prompts, completions, completion_ids, **kw):
    raise RuntimeError("bad reward")


def hanging(prompts, completions, completion_ids, **kw):
    time.sleep(600)
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("hostile") / "hostile_tools.py"
    f.write_text(HOSTILE)
    return f


def _alive_with(marker: str) -> list:
    """Processes anywhere (an orphan is re-parented) whose command line names `marker`."""
    psutil = pytest.importorskip("psutil")
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_hostile_tools_fail_the_call_and_the_process_is_replaced(hostile, tools) -> None:
    import time

    hog, segv, kill9, spawn = load_tools([f"{hostile}:{n}" for n in ("hog", "segv", "kill9", "spawn_and_hang")])
    # A timeout with room for the hog to fill its 256 MiB on a loaded machine.
    runner = ToolRunner([*tools[:1], hog, segv, kill9, spawn], timeout_s=3.0, memory_mb=256)
    marker = f"grandchild-{time.monotonic_ns()}"
    try:
        assert runner.call("hog", {"n": 2**24}) == (
            "{'error': 'hog: the tool process ran out of memory (objective.tool_memory_mb=256)'}",
            True,
        )
        assert runner.call("segv", {"x": 0}) == ("{'error': 'segv: the tool process was killed by SIGSEGV'}", True)
        assert runner.call("kill9", {"x": 0}) == ("{'error': 'kill9: the tool process was killed by SIGKILL'}", True)
        assert runner.call("spawn_and_hang", {"marker": marker}) == (
            "{'error': 'spawn_and_hang: timed out after 3 s'}",
            True,
        )
        assert runner.call("add", {"a": 1, "b": 2}) == ("3", False)  # a fresh process each time
        assert (runner.timeouts, runner.restarts) == (1, 4)
    finally:
        runner.close()
    deadline = time.monotonic() + 5
    while _alive_with(marker) and time.monotonic() < deadline:  # the group's SIGKILL takes a moment
        time.sleep(0.05)
    assert not _alive_with(marker)  # what the tool started died with its process group


def test_reward_functions_in_the_child_process(hostile) -> None:
    """A user reward runs in the child: its values (None kept), and one line naming it when it raises or
    outlasts the timeout (the run then stops with exit 2: TRL raises too)."""
    import os

    specs = [f"{hostile}:{n}" for n in ("score", "raising", "hanging")]
    runner = ToolRunner([], timeout_s=1.0, rewards=specs)
    try:
        args = (["p", "p"], ["ab", "skip"], [[1, 2], [3]], {"answer": ["x", "y"]})
        assert runner.score(specs[0], *args) == [2.0, None]
        assert runner.proc is not None and runner.proc.pid != os.getpid()
        with pytest.raises(InputError, match=rf"reward function '{specs[1]}' raised: RuntimeError: bad reward"):
            runner.score(specs[1], *args)
        with pytest.raises(InputError, match=rf"reward function '{specs[2]}' failed \(timed out after 1 s\)"):
            runner.score(specs[2], *args)
    finally:
        runner.close()


def test_round_budget_bounds_a_ranks_calls(tools) -> None:
    """With data-parallel peers waiting in a collective, the calls between two collectives share a budget: a
    call gets what is left, later ones fail at once, and a new round (after a collective) has it again."""
    import time

    runner = ToolRunner(tools, timeout_s=5.0, round_budget_s=1.5)
    try:
        runner.call("add", {"a": 1, "b": 1})  # the process started, the round's clock reset after
        runner.new_round()
        began = time.monotonic()
        assert runner.call("sleep", {"s": 30})[0].startswith("{'error': 'sleep: timed out after 1.")
        text, failed = runner.call("add", {"a": 1, "b": 1})
        assert failed and "no time left" in text and time.monotonic() - began < 3
        runner.new_round()
        assert runner.call("add", {"a": 1, "b": 1}) == ("2", False)
        assert runner.timeouts == 2
    finally:
        runner.close()


def test_the_tool_process_dies_with_its_worker(hostile, tmp_path: Path) -> None:
    """A worker SIGKILLed (no close(), no cleanup) while its tool process is busy in a call that hangs takes
    that process along (PR_SET_PDEATHSIG; the closed pipe alone would not end a call that never returns)."""
    import json
    import subprocess
    import sys
    import time

    spec = f"{hostile}:hanging"
    request = {"op": "score", "reward": spec, "prompts": [], "completions": [], "completion_ids": [], "columns": {}}
    script = (
        "import os, sys\n"
        "from dtlaunch.inputs.tools import ToolRunner\n"
        f"r = ToolRunner([], 30, rewards=[{spec!r}])\n"
        "r._process()\n"
        f"r.proc.stdin.write({(json.dumps(request) + chr(10)).encode()!r})\n"
        "r.proc.stdin.flush()\n"
        "print(r.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
