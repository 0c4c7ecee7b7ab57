"""Tools named in objective.tools (objective=grpo): Python functions the model may call while it generates,
as TRL's GRPOTrainer(tools=[...]) takes them. A name is `module:function` (imported from sys.path) or
`path/to/file.py:function`, loaded like a reward function (dtlaunch.inputs.rewards.import_function).

Each function's JSON schema comes from its type hints and its docstring (transformers' get_json_schema, the
schema apply_chat_template renders into the prompt): every argument needs a type hint and an `Args:` line.
`check_tools` imports every tool and builds its schema before any worker starts.

A call runs with the arguments the model wrote (`fn(**arguments)`); its result reaches the model as the text
`str(result)`. A call that raises, names no tool, or (in a child process) times out, ends the process or runs
out of memory, returns `{"error": "..."}` to the model instead, as TRL does, and counts as a failure. With
objective.tool_timeout_s > 0 the calls run in one child process per rank (`python -m dtlaunch.inputs.tools`,
which imports the tools again), the user's reward functions too (objective.rewards' `module:function` and
`file.py:function`; the built-ins are dtlaunch's and run in the worker): a call still running after the
timeout, or one that ends the process (os._exit, a signal, a segfault) or exhausts its address space
(objective.tool_memory_mb, RLIMIT_AS), has the process killed and replaced. The child runs in a session of
its own, so what a tool starts dies with it (the whole process group is killed), and it asks the kernel to
kill it when the worker dies (dtlaunch.run.parent_death). With 0 everything runs in the worker itself,
without a timeout or a limit.

A reward function that raises, times out or ends its process stops the run (InputError: one line naming
the function, exit 2), as TRL raises: a reward that is silently missing would train on wrong advantages.

Between two collectives of data-parallel ranks (round_budget_s: half the collective timeout) a rank's calls
share one budget: a call gets at most what is left of it, and a call after it is spent fails at once, so
that no rank reaches its next collective after its peers' timeout.

The module imports no torch: the child process starts in a fraction of a second.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from dtlaunch.errors import InputError
from dtlaunch.inputs.rewards import Reward, call_reward, import_function, load_rewards, user_rewards

if TYPE_CHECKING:
    from dtlaunch.config.schema import ObjectiveConfig

KEY = "objective.tools"
ENV_KEY = "objective.environment"
ENVS_KEY = "objective.environments"
NOT_TOOLS = ("reset", "get_reward")  # an environment's methods that are no tools (TRL)
READY = b"ready"
STARTUP_S = 120.0  # the child's start (an interpreter, the tools' imports) is not the call's time
OUT_OF_MEMORY = 86  # the child's exit code after a MemoryError (its address-space limit reached)


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
    return _tool(import_function(spec, KEY), spec, KEY)


def _tool(fn: Callable[..., Any], spec: str, key: str) -> Tool:
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise InputError(f"{KEY} needs transformers (its get_json_schema): pip install 'dtlaunch[hf]'") from None
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # TypeHintParsingException, DocstringParsingException: the user's function's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{key}: '{spec}' has no JSON schema ({first}): give every argument a type hint and a docstring with "
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


def check_tools(o: ObjectiveConfig) -> list[Tool]:
    """objective.tools imported and their schemas built (before any worker starts)."""
    return load_tools([str(s) for s in o.tools])


@dataclass(frozen=True)
class Environment:
    key: str  # the `environment` column's value selecting it; "" for objective.environment
    spec: str  # as the config names its factory
    cls: type  # the instances' class (its name: the reward's)
    tools: list[Tool]  # its public methods (bound to a stand-in: the schemas; calls go to an instance)
    has_reward: bool
    config_key: str = field(default=ENV_KEY)

    def tool_names(self) -> list[str]:
        return [t.name for t in self.tools]


def _methods(cls: type) -> dict[str, Callable[..., Any]]:
    """TRL's tool methods: the class's functions not starting with _, but reset and get_reward (listed on the
    class: getmembers on an instance would evaluate its properties)."""
    return {
        n: f for n, f in inspect.getmembers(cls, predicate=inspect.isfunction) if n not in NOT_TOOLS and n[:1] != "_"
    }


def load_environment(spec: str, key: str = "", config_key: str = ENV_KEY) -> Environment:
    """The factory imported and its class's methods checked: `reset` callable, every tool method with a schema.
    A class is read as is; another factory is called once (as TRL probes one instance) for its class."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise InputError(f"{config_key}: '{spec}' is no environment: use module:Class or path/to/file.py:Class")
    factory = import_function(spec, config_key)
    if isinstance(factory, type):
        cls = factory
    else:
        try:
            cls = type(factory())
        except Exception as exc:  # noqa: BLE001 - the user's factory
            raise InputError(f"{config_key}: '{spec}' raised when called ({type(exc).__name__}: {exc})") from None
    if not callable(getattr(cls, "reset", None)):
        raise InputError(
            f"{config_key}: '{spec}' ({cls.__name__}) has no callable `reset`: define reset(self, **kwargs) "
            f"returning the text to append to the prompt (or None)"
        )
    tools = [_tool(types.MethodType(fn, object()), f"{spec}.{n}", config_key) for n, fn in _methods(cls).items()]
    return Environment(key, spec, cls, tools, callable(getattr(cls, "get_reward", None)), config_key)


def check_environments(o: ObjectiveConfig, tools: Sequence[Tool] = ()) -> list[Environment]:
    """objective.environment (one, key "") or objective.environments (name -> factory, selected by the dataset's
    `environment` column): imported and checked before any worker starts; no method named like a tool."""
    single, named = str(getattr(o, "environment", "") or ""), dict(getattr(o, "environments", {}) or {})
    if single and named:
        raise InputError(
            f"{ENV_KEY}={single} and {ENVS_KEY} are both set: use one (objective.environments selects by the "
            f"dataset's `environment` column)"
        )
    envs = [load_environment(single)] if single else []
    envs += [load_environment(str(v), str(k), ENVS_KEY) for k, v in named.items()]
    if envs and not list(getattr(o, "rewards", [])) and not any(e.has_reward for e in envs):
        raise InputError(
            f"objective.rewards is empty and {envs[0].config_key}: '{envs[0].spec}' has no get_reward: name a "
            f"reward function, or give the environment a get_reward(self) -> float"
        )
    standalone = {t.name: t.spec for t in tools}
    for env in envs:
        for t in env.tools:
            if t.name in standalone:
                raise InputError(
                    f"{env.config_key}: '{env.spec}' has a method {t.name}, as the tool '{standalone[t.name]}' is "
                    f"called: the model calls tools by name, so rename one"
                )
    return envs


def call_in_process(
    tools: dict[str, Callable[..., Any]], name: str, arguments: Any, memory_fatal: bool = False
) -> tuple[str, bool]:
    """(the result's text, whether the call failed): TRL's semantics for one function call. `memory_fatal` (in
    the child): a MemoryError is not the tool's answer but the process's end (see _serve)."""
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return str(tools[name](**arguments)), False
    except MemoryError:
        if memory_fatal:
            raise
        return str({"error": "MemoryError"}), True
    except Exception as exc:  # noqa: BLE001 - the user's tool: whatever it raises goes back to the model
        return str({"error": str(exc)}), True


class EnvironmentFailure(InputError):
    """An environment's constructor, reset or get_reward raised, timed out or ended its process (TRL raises):
    one line naming the class, as a reward function that raises (dtlaunch.inputs.rewards.call_reward)."""


class Host:
    """The tools, the environment instances and the reward functions, where the calls run (the child process,
    or the worker)."""

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]],
        factories: dict[str, Callable[..., Any]],
        rewards: Optional[dict[str, Callable[..., Any]]] = None,
        in_child: bool = False,
    ) -> None:
        self.tools, self.factories, self.rewards, self.in_child = tools, factories, rewards or {}, in_child
        self.instances: dict[str, tuple[Any, dict[str, Callable[..., Any]]]] = {}

    def handle(self, request: dict) -> dict:
        op, instance = request.get("op", "call"), request.get("instance")
        if op == "call":
            table = self.tools
            if instance is not None:
                if instance not in self.instances:
                    return {"result": str({"error": f"environment instance {instance} was lost"}), "failed": True}
                table = {**self.tools, **self.instances[instance][1]}
            result, failed = call_in_process(table, request["name"], request["arguments"], self.in_child)
            return {"result": result, "failed": failed}
        if op == "score":  # a reward function on the rank's completions, checked as in the worker
            name = request["reward"]
            try:
                values = call_reward(
                    Reward(name, self.rewards[name], 1.0),
                    request["prompts"],
                    request["completions"],
                    request["completion_ids"],
                    request["columns"],
                    request.get("record", ""),
                )
            except InputError as exc:
                return {"error": str(exc)}
            return {"result": [None if math.isnan(v) else v for v in values]}
        try:
            if op == "create":
                obj = self.factories[request["env"]]()
                self.instances[instance] = (obj, {n: getattr(obj, n) for n in _methods(type(obj))})
                return {"result": None}
            if instance not in self.instances:
                return {"result": None, "lost": True}
            obj = self.instances[instance][0]
            if op == "reset":
                out = obj.reset(**request["record"])
                if out is not None and not isinstance(out, str):
                    raise TypeError(f"reset returned {type(out).__name__}: return a str or None")
                return {"result": out}
            if op == "reward":
                value = obj.get_reward()
                return {"result": None if value is None else float(value)}
        except Exception as exc:  # noqa: BLE001 - the user's environment: the worker reports it
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": f"unknown request {op}"}


class ToolRunner:
    """Runs the user's code: in a child process with a per-call timeout and an address-space limit
    (timeout_s > 0), else in this process. With environments: their instances too, by id (create, reset,
    call, get_reward); with `rewards` (their specs), the reward functions (`score`).

    Counts, for the rollout's metrics, the calls that timed out and the times the process was replaced."""

    def __init__(
        self,
        tools: Sequence[Tool],
        timeout_s: float,
        environments: Sequence[Environment] = (),
        rewards: Sequence[str] = (),
        memory_mb: int = 0,
        round_budget_s: float = 0.0,
    ) -> None:
        self.tools = {t.name: t.fn for t in tools}
        self.specs = [t.spec for t in tools]
        self.envs = {e.key: e for e in environments}
        self.reward_specs = list(rewards)
        self.timeout_s, self.memory_mb, self.round_budget_s = float(timeout_s), int(memory_mb), float(round_budget_s)
        self.proc: Optional[subprocess.Popen] = None
        self._buffer = b""
        self._round_start = time.monotonic()
        self.live: dict[str, str] = {}  # instance id -> its environment's key, in the current process
        self.timeouts = self.restarts = 0
        self.host: Optional[Host] = None
        if self.timeout_s <= 0:
            factories = {e.key: import_function(e.spec, e.config_key) for e in environments}
            rewards_here = {r: import_function(r, "objective.rewards") for r in self.reward_specs}
            self.host = Host(self.tools, factories, rewards_here)

    def new_round(self) -> None:
        """The rank just left a collective: the calls until the next one share round_budget_s."""
        self._round_start = time.monotonic()

    def call(self, name: str, arguments: Any, instance: Optional[str] = None) -> tuple[str, bool]:
        names = set(self.tools)
        if instance is not None and instance in self.live:
            names |= set(self.envs[self.live[instance]].tool_names())
        if name not in names and (instance is None or instance in self.live):  # as TRL: no process needed
            return str({"error": f"Tool {name} not found."}), True
        try:
            json.dumps(arguments)
        except (TypeError, ValueError) as exc:
            return str({"error": f"arguments are not JSON: {exc}"}), True
        reply, why = self._request({"op": "call", "name": name, "arguments": arguments, "instance": instance})
        if reply is None:
            return str({"error": f"{name}: {why}"}), True
        return str(reply["result"]), bool(reply["failed"])

    def score(
        self, spec: str, prompts: Any, completions: Any, completion_ids: Any, columns: dict, record: str = ""
    ) -> list[Optional[float]]:
        """The reward function `spec` on the rank's completions (None: does not apply); InputError naming it (and
        `record`, the launcher's check) when it raised, returned something else than numbers, timed out or
        ended its process."""
        request = {
            "op": "score",
            "reward": spec,
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(c) for c in completion_ids],
            "columns": {k: list(v) for k, v in columns.items()},
            "record": record,
        }
        reply, why = self._request(request)
        if reply is None:
            where = f" on {record}" if record else ""
            raise InputError(
                f"objective.rewards: reward function '{spec}' failed{where} ({why}): fix it (a reward that is "
                f"missing would train on wrong advantages, so the run stops as TRL's does)"
            )
        if "error" in reply:
            raise InputError(reply["error"])
        return list(reply["result"])

    def create(self, instance: str, env: str) -> None:
        self._checked("create", env, {"op": "create", "instance": instance, "env": env})
        self.live[instance] = env

    def reset(self, instance: str, env: str, record: dict) -> Optional[str]:
        """The instance (created in this process when it is not yet) reset: the text reset returned, or None."""
        if self.live.get(instance) != env:
            self.create(instance, env)
        return self._checked("reset", env, {"op": "reset", "instance": instance, "record": record}).get("result")

    def get_reward(self, instance: str) -> Optional[float]:
        """The instance's get_reward(); None when it was lost with its process."""
        if instance not in self.live:
            return None
        reply = self._checked("get_reward", self.live[instance], {"op": "reward", "instance": instance})
        return reply.get("result")

    def _checked(self, what: str, key: str, request: dict) -> dict:
        reply, why = self._request(request)
        if reply is None or "error" in reply:
            env = self.envs[key]
            raise EnvironmentFailure(
                f"{env.config_key}: {env.cls.__name__}.{what} failed ({why if reply is None else reply['error']}): "
                f"fix the environment '{env.spec}'"
            )
        return reply

    def _time_left(self) -> float:
        if self.round_budget_s <= 0:
            return self.timeout_s
        return min(self.timeout_s, self.round_budget_s - (time.monotonic() - self._round_start))

    def _request(self, request: dict) -> tuple[Optional[dict], str]:
        """(the reply, "") or (None, why: the process timed out, ended or did not start)."""
        if self.host is not None:
            return self.host.handle(request), ""
        left = self._time_left()
        if left <= 0:  # the rank must reach its next collective before its peers' timeout
            self.timeouts += 1
            return None, (
                f"no time left: the calls between two collectives may take {self.round_budget_s:g} s "
                f"(half of launch.timeout_s)"
            )
        proc = self._process()
        if proc is None:
            return None, "the tool process did not start"
        left = self._time_left()  # a restart's seconds count too
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            line = self._read_line(proc, time.monotonic() + max(left, 0.0))
        except OSError:  # BrokenPipeError: the process is gone
            line = b""
        if not line:  # timed out (None), or the process ended (a crash, os._exit, a signal, out of memory)
            code = self._ended(proc) if line is not None else None
            self.close()
            self.restarts += 1
            if line is None:
                self.timeouts += 1
                return None, f"timed out after {round(left, 1):g} s"
            return None, self._why_ended(code)
        reply = json.loads(line)
        if reply.get("lost"):
            self.live.pop(request.get("instance"), None)
        return reply, ""

    def _why_ended(self, code: Optional[int]) -> str:
        if code == OUT_OF_MEMORY:
            return f"the tool process ran out of memory (objective.tool_memory_mb={self.memory_mb})"
        if code is not None and code < 0:
            try:
                return f"the tool process was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"the tool process exited ({code})"

    def _process(self) -> Optional[subprocess.Popen]:
        """The child, started (and its tools imported: a READY line) before any call's time counts. In a
        session of its own: close() kills its whole process group, whatever the user's code started. The
        kernel's parent-death signal follows the thread that forks it: the rollout's, the worker's main
        thread, which lives as long as the worker."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtlaunch.inputs.tools", json.dumps(self._child_args())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""
        if self._read_line(self.proc, time.monotonic() + max(STARTUP_S, self.timeout_s)) != READY:
            self.close()
            return None
        return self.proc

    def _child_args(self) -> dict:
        return {
            "tools": self.specs,
            "environments": {k: [e.spec, e.config_key] for k, e in self.envs.items()},
            "rewards": self.reward_specs,
            "memory_mb": self.memory_mb,
            "parent": os.getpid(),
        }

    @staticmethod
    def _ended(proc: subprocess.Popen) -> Optional[int]:
        """The exit code of a process whose stdout closed (it may take a moment to exit), read without reaping
        it: until close() has killed its group, its pid (the group's id) must not be reused."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return proc.returncode
            if info is not None:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            time.sleep(0.01)
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
        """The child and everything in its process group killed (before it is reaped: until then its pid,
        the group's id, cannot name another group), and reaped."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self.proc = None
        self.live.clear()  # the instances died with their process


def rollout_instances(keys: Sequence[str]) -> list[str]:
    """One instance id per rollout, each environment's counted from 0 (TRL's pool: an instance is made once and
    reset for every later rollout in its place)."""
    cursor: dict[str, int] = {}
    out = []
    for key in keys:
        cursor[key] = cursor.get(key, -1) + 1
        out.append(f"{key}/{cursor[key]}")
    return out


def environment_keys(envs: Sequence[Environment], columns: Sequence[dict]) -> list[str]:
    """Each rollout's environment: the one of objective.environment, or the record's `environment` column."""
    if len(envs) == 1 and envs[0].key == "":
        return [""] * len(columns)
    known = {e.key for e in envs}
    keys = [str(c.get("environment")) for c in columns]
    for k in keys:
        if k not in known:
            raise InputError(f"{ENVS_KEY}: a prompt's environment column is '{k}', not one of {sorted(known)}")
    return keys


def reset_prompts(
    runner: ToolRunner, keys: Sequence[str], instances: Sequence[str], prompts: Sequence[Any], columns: Sequence[dict]
) -> list[Any]:
    """TRL: each rollout's instance reset with its record (`prompt` and the other columns; with several
    environments, not `environment`); a returned text is appended to the last message's content."""
    out = []
    for key, instance, prompt, cols in zip(keys, instances, prompts, columns, strict=True):
        record = {"prompt": prompt, **cols}
        if key:
            record.pop("environment", None)
        observation = runner.reset(instance, key, record)
        if observation is None:
            out.append(prompt)
            continue
        if not isinstance(prompt, list):
            raise InputError(f"{ENV_KEY}: reset returned text to append to a prompt that is text: give chat prompts")
        out.append(prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}])
    return out


def environment_reward_columns(envs: Sequence[Environment]) -> list[Environment]:
    """The environments that own a reward, one per factory (TRL: several names for one class score once)."""
    out: list[Environment] = []
    for e in envs:
        if e.has_reward and all(o.spec != e.spec for o in out):
            out.append(e)
    return out


def environment_rewards(
    runner: ToolRunner, env: Environment, envs: Sequence[Environment], keys: Sequence[str], instances: Sequence[str]
) -> list[Optional[float]]:
    """`env`'s class's get_reward() of each rollout of that class; None for the others (TRL: NaN, ignored)."""
    same = {e.key for e in envs if e.spec == env.spec}
    return [runner.get_reward(i) if k in same else None for k, i in zip(keys, instances, strict=True)]


def _serve(args: dict) -> None:
    """The child process: one JSON request per line on stdin, one reply per line on the original stdout.
    Whatever the tools print goes to stderr, so it never garbles a reply. It dies with the worker, and within
    objective.tool_memory_mb of address space: a MemoryError ends it (exit OUT_OF_MEMORY), since a process that
    ran out may be left in any state; the worker answers the call with an error and starts another."""
    from dtlaunch.run.parent_death import die_with_parent

    die_with_parent(int(args["parent"]))
    if int(args["memory_mb"]) > 0:
        import resource

        limit = int(args["memory_mb"]) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # The functions alone: their schemas (transformers) were built and checked by the worker.
    tools = {}
    for spec in args["tools"]:
        fn = import_function(spec, KEY)
        tools[getattr(fn, "__name__", spec.rpartition(":")[2])] = fn
    factories = {k: import_function(spec, key) for k, (spec, key) in args["environments"].items()}
    rewards = {spec: import_function(spec, "objective.rewards") for spec in args["rewards"]}
    host = Host(tools, factories, rewards, in_child=True)
    out.write(READY.decode() + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = host.handle(json.loads(line))
        except MemoryError:  # the traceback (and what the call allocated) is gone after this block
            reply = None
        if reply is None:
            os._exit(OUT_OF_MEMORY)
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))


def check_rewards(o: ObjectiveConfig, record: dict[str, Any], prompt_field: str, where: str) -> list[Reward]:
    """Import every reward function and call it once on `record`'s prompt with two stand-in completions
    (the prompt's own text and an empty one), before any worker starts. The user's functions are called
    where the workers will call them (objective.tool_timeout_s > 0: a child process with its timeout and
    memory limit, dtlaunch.inputs.tools), so a function that hangs or crashes is one line here too."""
    rewards = load_rewards(o)
    prompt = record.get(prompt_field)
    columns = {k: [v, v] for k, v in record.items() if k != prompt_field}
    text = prompt if isinstance(prompt, str) else ""
    completions: list[Any] = [text, ""] if isinstance(prompt, str) else [[{"role": "assistant", "content": ""}]] * 2
    remote = user_rewards(o) if float(o.tool_timeout_s) > 0 else []
    runner = None
    if remote:
        runner = ToolRunner([], float(o.tool_timeout_s), rewards=remote, memory_mb=int(o.tool_memory_mb))
    try:
        for r in rewards:
            if runner is not None and r.name in remote:
                runner.score(r.name, [prompt, prompt], completions, [[], []], columns, where)
            else:
                call_reward(r, [prompt, prompt], completions, [[], []], columns, where)
    finally:
        if runner is not None:
            runner.close()
    return rewards
