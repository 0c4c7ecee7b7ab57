"""Issue #51, "your code cannot take the run down": GRPO with tools that hang (and start a process that would
outlive them), leave a process running, end their process with os._exit and allocate without end, and a
reward function that raises at step 4. The tools' failures reach the model as errors and count in the
metrics while training goes on; the reward stops the run in one line with exit 2 after the step-3
checkpoint; no process of the run is left; the same command, once the reward is fixed, resumes from step 3
and finishes.

One process, a 4-row rollout per step, completions replayed (a random tiny model writes no tool calls): two
`dtlaunch train` runs in all.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from grpo_toy import TOOL_TEMPLATE, toy_args, write_byte_tokenizer

psutil = pytest.importorskip("psutil")

TOOLS = '''
import os
import subprocess
import sys
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def hang(a: int, b: int) -> int:
    """Never answer, after starting a process that would outlive the call.

    Args:
        a: The first.
        b: The second.
    """
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", __file__])
    time.sleep(600)


def spawn(a: int, b: int) -> int:
    """Answer, leaving a process running in the background.

    Args:
        a: The first.
        b: The second.
    """
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", __file__])
    return a + b


def die(a: int, b: int) -> int:
    """End the process.

    Args:
        a: The first.
        b: The second.
    """
    os._exit(7)


def hog(a: int, b: int) -> int:
    """Allocate without end.

    Args:
        a: The first.
        b: The second.
    """
    chunks = []
    while True:
        chunks.append(bytearray(2**24))
'''
# Raises on the completions of step 4 (their answer is "boom") while the file `armed` is beside it.
REWARD = """
from pathlib import Path

ARMED = Path(__file__).with_name("armed")


def saw_five(prompts, completions, completion_ids, **kw):
    if ARMED.exists() and any("boom" in str(c) for c in completions):
        raise RuntimeError("the reward's own bug")
    return [float(any(m["role"] == "tool" and m["content"] == "5" for m in c)) for c in completions]
"""


def _left_behind(marker: str) -> list[str]:
    """Live processes anywhere (an orphan is re-parented to init) whose command line names `marker`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(p.info["cmdline"] or [])
            if marker in line and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid}: {line[:200]}")
        except psutil.Error:
            continue
    return found


def test_hostile_tools_and_a_raising_reward(trainer, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = write_byte_tokenizer(tmp_path / "tok", TOOL_TEMPLATE)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "armed").write_text("")
    prompts = [[{"role": "user", "content": q}] for q in ("2 + 3?", "Add 2 and 3.")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tok = Tokenizer.from_file(str(tokenizer))

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def call(name: str) -> list[int]:
        return ids("<tool_call>" + json.dumps({"name": name, "arguments": {"a": 2, "b": 3}}) + "</tool_call><|im_end|>")

    def rollout(names: list[str], answer: str = "5") -> list:
        return [[call(n), ids(f"{answer}<|im_end|>")] for n in names]

    rollouts = [
        rollout(["hang", "die", "hog", "add"]),  # step 1: three tools fail, one works after them
        rollout(["add", "die", "spawn", "add"]),  # spawn's process lives on until the run ends
        rollout(["add", "add", "add", "add"]),
        rollout(["add", "add", "add", "add"], answer="boom"),  # step 4: the reward raises on these
        rollout(["add", "add", "add", "add"]),
    ]
    replay = tmp_path / "replay.jsonl"
    replay.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    data = ["data.kind=jsonl", f"data.path={tmp_path / 'prompts.jsonl'}", f"data.tokenizer={tokenizer}"]
    args = toy_args(
        data,
        "training.steps=5",
        "training.seq_len=320",
        "objective.max_completion_length=256",
        "objective.num_generations=2",
        "training.micro_batch=4",
        "training.global_batch=4",
        f"objective.tools=[{tmp_path / 'tools.py'}:add,{tmp_path / 'tools.py'}:hang,"
        f"{tmp_path / 'tools.py'}:die,{tmp_path / 'tools.py'}:hog,{tmp_path / 'tools.py'}:spawn]",
        f"objective.rewards=[{tmp_path / 'rewards.py'}:saw_five]",
        "objective.tool_timeout_s=3",
        "objective.tool_memory_mb=256",
        f"debug.replay_completions={replay}",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=3",
        vocab=260,
    )
    run = tmp_path / "run"
    proc = trainer.run(run, *args, expect_ok=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    spec = f"{tmp_path / 'rewards.py'}:saw_five"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dtlaunch: error: objective.rewards: reward function '{spec}' raised: RuntimeError: the reward's own bug"
    ), proc.stderr[-3000:]
    metrics = trainer.metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]  # the tools' failures did not stop it
    first, second = metrics[0], metrics[1]
    assert (first["tools/failures"], first["tools/timeouts"], first["tools/restarts"]) == (3, 1, 3), first
    assert (second["tools/failures"], second["tools/timeouts"], second["tools/restarts"]) == (1, 0, 1), second
    assert metrics[2]["tools/failures"] == 0 and first["tools/failure_frequency"] == 0.75
    sample = [json.loads(x) for x in (run / "completions" / "step-1.jsonl").read_text().splitlines()]
    assert "{'error': 'hang: timed out after 3 s'}" in sample[0]["completion"], sample[0]
    assert "{'error': 'die: the tool process exited (7)'}" in sample[1]["completion"], sample[1]
    out_of_memory = "{'error': 'hog: the tool process ran out of memory (objective.tool_memory_mb=256)'}"
    assert out_of_memory in sample[2]["completion"], sample[2]
    assert "tool\n5" in sample[3]["completion"], sample[3]  # the process replaced: the next call works
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))[-1] == (
        "step-00000003"
    )
    # Nothing of the run is left: the tool processes (their command line names tools.py) and the processes the
    # hanging tool and `spawn` started (they name tools.py too).
    deadline = time.monotonic() + 10
    while _left_behind(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left_behind(str(tmp_path))

    # The reward fixed, the same command resumes from the step-3 checkpoint and finishes.
    (tmp_path / "armed").unlink()
    again = trainer.run(run, *args)
    assert "resumed from step-00000003" in again.stdout + again.stderr
    assert [m["step"] for m in trainer.metrics(run)] == [1, 2, 3, 4, 5]
    assert not _left_behind(str(tmp_path))
