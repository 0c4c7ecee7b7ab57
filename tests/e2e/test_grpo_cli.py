"""objective=grpo through the CLI: a tiny model learns a verifiable toy task from its own samples, and bad
GRPO input is refused in one line before any worker starts.

The task ("answer with token X"): every prompt is a few words, its answer column is "7", and the built-in
`accuracy` reward is 1 when the last number of the (at most two-token) completion is 7. A freshly
initialised model over a 16-word vocabulary starts near chance (about 1 in 8); GRPO must bring the mean
reward to >= 0.8. (A per-prompt task, "copy the digit", collapses groups onto wrong digits at this size:
a group whose G samples agree has no spread and so no gradient.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from grpo_toy import toy_args, write_tokenizer


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo_toy")
    write_tokenizer(out / "tokenizer.json")
    prompts = [f"{a} {b}" for a in ("the", "a", "is", "copy") for b in ("the", "a")]
    lines = [json.dumps({"prompt": p, "answer": "7"}) for p in prompts]
    (out / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return out


def grpo_args(toy: Path, *extra: str) -> list[str]:
    data = ["data.kind=jsonl", f"data.path={toy / 'prompts.jsonl'}", f"data.tokenizer={toy / 'tokenizer.json'}"]
    return toy_args(data, *extra)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_tiny_model_learns_toy_task(trainer, toy: Path, tmp_path: Path, peft: str) -> None:
    lr = "1e-2" if peft == "none" else "3e-2"
    run = tmp_path / "run"
    proc = trainer.run(run, *grpo_args(toy, "training.steps=15", f"optim.lr={lr}", f"peft={peft}"))
    metrics = trainer.metrics(run)
    rewards = [m["reward"] for m in metrics]
    assert rewards[0] <= 0.3, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    sample = (run / "completions" / "step-15.jsonl").read_text().splitlines()
    assert sample and "accuracy" in json.loads(sample[0])["rewards"]
    # Item 6's metrics: every step's line, the end-of-run summary (file and printed) and the report.
    last = metrics[-1]
    for key in ("reward_std", "rewards/accuracy/mean", "rewards/accuracy/std", "completions/mean_length"):
        assert key in last, key
    assert 1 <= last["completions/mean_length"] <= last["completions/max_length"] <= 2
    assert 0 <= last["completions/clipped_ratio"] <= 1 and last["clip_ratio/low_mean"] == 0  # mu = 1: ratio 1
    assert 0 < last["entropy"] <= math.log(16) and "kl" not in last  # beta = 0: no KL term
    assert last["time/generation_s"] > 0 and last["time/training_s"] > 0 and last["generated_tokens_per_s"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["generation_share"] < 1 and summary["reward"] == rewards[-1]
    assert "GRPO" in proc.stdout and "% of step time generating at" in proc.stdout
    from dtlaunch.report.html import run_report
    from dtlaunch.report.rundata import read_run

    assert "<h2>rewards</h2>" in run_report(read_run(run))


def bad_reward_file(tmp_path: Path, body: str) -> str:
    f = tmp_path / "my_rewards.py"
    f.write_text(f"def reward(prompts, completions, completion_ids, **kw):\n    {body}\n")
    return f"{f}:reward"


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise ValueError('boom')", "reward function '{spec}' raised on r.jsonl:1: ValueError: boom"),
        ("return [1.0]", "returned 1 values for 2 completions on r.jsonl:1"),
        ("return [float('nan')] * len(completions)", "returned nan on r.jsonl:1"),
        ("return ['x'] * len(completions)", "returned 'x' (str) on r.jsonl:1"),
        (None, "objective.rewards: 'nosuchmodule:f' cannot be imported (ModuleNotFoundError"),
        ("import os; os._exit(3)", "reward function '{spec}' failed on r.jsonl:1 (the tool process exited (3))"),
    ],
)
def test_bad_reward_function(tmp_path: Path, body, message) -> None:
    """Each reward function is imported and called once on the first record (in-process: what the launcher
    runs while preparing the prompts)."""
    from omegaconf import OmegaConf

    from dtlaunch.errors import InputError
    from dtlaunch.inputs.tools import check_rewards

    spec = bad_reward_file(tmp_path, body) if body else "nosuchmodule:f"
    # Called in the child process the workers call it in (objective.tool_timeout_s > 0): the same messages.
    fields = {"format_regex": "", "answer_field": "answer", "tool_timeout_s": 30.0, "tool_memory_mb": 4096}
    o = OmegaConf.create({"rewards": [spec], "reward_weights": [], **fields})
    with pytest.raises(InputError) as err:
        check_rewards(o, {"prompt": "the a", "answer": "7"}, "prompt", "r.jsonl:1")
    assert message.format(spec=spec) in str(err.value) and "\n" not in str(err.value)


def test_bad_reward_refused_before_workers(trainer, toy: Path, tmp_path: Path) -> None:
    spec = bad_reward_file(tmp_path, "raise ValueError('boom')")
    proc = trainer.run(tmp_path / "run", *grpo_args(toy, f"objective.rewards=[{spec}]"), expect_ok=False)
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"dtlaunch: error: objective.rewards: reward function '{spec}' raised on")
    )
    assert not (tmp_path / "run" / "logs").exists() or not list((tmp_path / "run" / "logs").iterdir())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["training.global_batch=20", "training.micro_batch=4"], "is not a multiple of objective.num_generations=8"),
        (["strategy.pp=2", "launch.nproc_per_node=2"], "objective=grpo does not generate under pipeline parallel"),
        (["strategy.cp=2", "launch.nproc_per_node=2"], "objective=grpo does not generate under strategy.cp=2 yet"),
        (["data.format=text"], "objective=grpo generates its completions from prompts, not data.format=text"),
        (["objective.max_completion_length=8"], "objective.max_completion_length=8 leaves no room for a prompt"),
        (
            ["objective.num_iterations=2", "checkpoint.every_steps=3"],
            "checkpoint.every_steps=3 is not a multiple of objective.num_iterations=2",
        ),
        (
            ["objective.importance_sampling_correction=true", "objective.importance_sampling_clip_min=3"],
            "objective.importance_sampling_clip_min=3.0 is not below objective.importance_sampling_clip_max=3.0",
        ),
    ],
)
def test_grpo_config_rules(toy: Path, extra: list, message: str) -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(grpo_args(toy, *extra)).cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(Exception, match="is unknown: use one of"):
        validate(compose(grpo_args(toy, "objective.loss_type=ppo")).cfg)


def test_prompt_too_long_refused(toy: Path, tmp_path: Path) -> None:
    """In-process: what the launcher runs on the prompts before any worker starts."""
    from dtlaunch.errors import InputError
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.run_data import prepare_run_data

    with pytest.raises(InputError) as err:
        prepare_run_data(compose(grpo_args(toy, "training.seq_len=3")).cfg, tmp_path)
    assert "8 of 8 prompts are longer than training.seq_len - objective.max_completion_length = 1 tokens" in str(
        err.value
    ) and "raise training.seq_len to at least 4" in str(err.value)


def test_fsdp_killed_or_preempted_and_resumed_equals_uninterrupted(trainer, toy: Path, tmp_path: Path) -> None:
    """FSDP2 (ZeRO-3) on two ranks, three optimizer steps per generation batch (mu = 3: steps 1-3 and 4-6
    each share a rollout), straight through; every step's rewards and loss must equal it, bit for bit, in:
    - a run whose rank 1 is SIGKILLed as step 5 begins (mid-way through the second batch), restarted by the
      launcher and resumed from the step-3 checkpoint: the resumed rollout regenerates what the
      uninterrupted one did from the same seeds and weights (checkpoints fall on batch boundaries:
      job.rules.grpo);
    - a run SIGTERMed while rank 1 holds at step 1, whose stop would land after step 1 or 2 (when the
      flag rides the step's collectives), mid-batch: it finishes the batch, saves step 3, exits 75, and the
      same command resumes it. It generates with one FSDP unit gathered at a time
      (objective.generation_gather=unit), the others with the whole model (auto, as the plan chose).
    All three with the sampler correction on (objective.importance_sampling_correction, per token): the
    sampler is the training model, so its log-probs are the training policy's to float rounding and every
    ratio is ~1, and the resumed rollouts' sampler log-probs are regenerated alike.
    (DDP trains alike within 1e-5: the replayed-completions test.)"""
    import signal
    import subprocess
    import sys
    import time

    common = grpo_args(
        toy,
        "training.steps=6",
        "training.micro_batch=8",
        "launch.nproc_per_node=2",
        "optim.lr=1e-2",
        "objective.num_iterations=3",
        "strategy=fsdp",
        "objective.importance_sampling_correction=true",
        "objective.importance_sampling_mode=token_truncate",
    )
    straight, killed, preempted = tmp_path / "straight", tmp_path / "killed", tmp_path / "preempted"
    trainer.run(straight, *common)
    kill = ["debug.fail_at_step=5", "debug.fail_mode=sigkill", "debug.fail_rank=1", "launch.max_restarts=1"]
    proc = trainer.run(killed, *common, "checkpoint.enabled=true", "checkpoint.every_steps=3", *kill)
    assert "resumed from step-00000003" in proc.stdout + proc.stderr

    # The flag raised before step 1 is read by every rank after step 1 or 2 (sync_interval_s=0: each step's
    # collective carries it), both mid-way through the first batch.
    resume = [*common, "checkpoint.enabled=true", "checkpoint.every_steps=999", "training.sync_interval_s=0"]
    resume.append("objective.generation_gather=unit")
    cmd = [sys.executable, "-m", "dtlaunch", "train", *trainer.FAST, *resume, f"run.dir={preempted}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    held = subprocess.Popen(
        [*cmd, "debug.hold_at_step=1", "debug.fail_rank=1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log, deadline = preempted / "logs" / "rank1.log", time.monotonic() + 300
    while not (log.is_file() and "holding at step 1" in log.read_text()):
        assert held.poll() is None and time.monotonic() < deadline, held.communicate()
        time.sleep(0.05)
    held.send_signal(signal.SIGTERM)
    out, err = held.communicate(timeout=300)
    assert held.returncode == 75 and "checkpoint saved at step 3" in err, out[-2000:] + err[-2000:]
    again = trainer.run(preempted, *resume)
    assert "resumed from step-00000003" in again.stdout + again.stderr

    def steps(run: Path) -> list[tuple]:
        return [(m["step"], m["loss"], m.get("reward")) for m in trainer.metrics(run)]

    assert steps(killed) == steps(straight) and len(steps(straight)) == 6
    assert steps(preempted) == steps(straight)
    for m in trainer.metrics(straight)[::3]:  # the steps that generated
        assert 0 <= m["sampling/sampling_logp_difference/mean"] <= m["sampling/sampling_logp_difference/max"] < 1e-4
        ratios = [m[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        assert 0.9999 < ratios[0] <= ratios[1] <= ratios[2] < 1.0001, m
    from dtlaunch.job.compose import load_resolved

    assert str(load_resolved(straight / "config.yaml").objective.generation_gather) == "whole"  # the plan's choice
    assert json.loads((preempted / "plan.json").read_text())["generation_gather"] == "unit"


def test_plan_of_the_generation_phase(trainer, toy: Path, tmp_path: Path) -> None:
    """A run whose peak is the rollout's generation (64 rows with a 259-position KV cache, 2-row micro-
    batches): the measured peak (the step includes the rollout; the second step's, once the optimizer state
    exists) is within 8 % of the plan."""
    run = tmp_path / "run"
    trainer.run(
        run,
        *grpo_args(toy, "training.steps=2", "training.micro_batch=2", "training.global_batch=64"),
        "training.seq_len=259",
        "objective.max_completion_length=256",
    )
    plan = json.loads((run / "plan.json").read_text())
    assert plan["peak_phase"] == "generation"
    measured = max(json.loads((run / "summary.json").read_text())["peak_mem_bytes_per_rank"])
    assert abs(measured / plan["peak_bytes"] - 1) <= 0.08, (measured, plan["peak_bytes"])


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> Path:
    """Three rollouts of 32 completions (1-2 tokens, some ending at <eos>) for debug.replay_completions."""
    import random

    rng = random.Random(3)
    rollouts = [
        [[rng.choice([1, *range(3, 13)]) for _ in range(rng.randint(1, 2))] for _ in range(32)] for _ in range(3)
    ]
    out = tmp_path_factory.mktemp("replay") / "replay.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in rollouts) + "\n")
    return out


# HSDP: two replicas of a two-way shard, each rank one group of G = 8 completions.
HSDP = ["strategy=fsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "launch.nproc_per_node=4"]


@pytest.mark.parametrize(
    "peft, layouts",
    [
        ("none", [["strategy=fsdp"], ["strategy=ddp"], ["strategy=tp"], HSDP]),
        ("lora", [["strategy=fsdp"], ["strategy=tp"]]),
        ("qlora", [["strategy=fsdp"]]),  # NF4 blocks small enough for the tiny model's row shards
    ],
)
def test_layouts_train_alike_on_replayed_completions(
    trainer, toy: Path, tmp_path: Path, replay: Path, peft: str, layouts: list
) -> None:
    """debug.replay_completions (a test hook) hands every layout the same completions; one process and each
    multi-rank layout (FSDP2, DDP, TP and HSDP; LoRA on FSDP2 and TP, QLoRA on FSDP2) must then see the same
    rewards and losses (within 1e-5) at every step."""
    common = grpo_args(
        toy, "training.steps=3", "training.micro_batch=8", f"debug.replay_completions={replay}", f"peft={peft}"
    )
    if peft == "qlora":
        common += ["peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"]
    trainer.run(tmp_path / "one", *common)
    a = trainer.metrics(tmp_path / "one")
    assert len(a) == 3 and any(abs(m["loss"]) > 1e-4 for m in a)  # the losses are not all zero
    for i, layout in enumerate(layouts):
        trainer.run(tmp_path / f"two{i}", *common, "launch.nproc_per_node=2", *layout)
        b = trainer.metrics(tmp_path / f"two{i}")
        assert [m["reward"] for m in a] == [m["reward"] for m in b], layout
        assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a, b, strict=True)), (layout, a, b)


def test_tensor_parallel_run_samples_as_one_process(trainer, toy: Path, tmp_path: Path) -> None:
    """strategy=tp on two ranks (sequence parallel on, the default) generates its own completions, sampled:
    from the same initial weights and seeds both TP ranks draw what one process draws, so every step's
    rewards are equal and the losses agree within 1e-5 (the TP rollout itself:
    tests/distributed/test_grpo_generation_tp.py). The one process decodes compiled
    (objective.generation_compile=true), the TP pair eagerly: the same draws too."""
    common = grpo_args(toy, "training.steps=2", "training.micro_batch=8", "optim.lr=1e-2")
    trainer.run(tmp_path / "one", *common, "objective.generation_compile=true")
    trainer.run(tmp_path / "tp", *common, "launch.nproc_per_node=2", "strategy=tp")
    a, b = trainer.metrics(tmp_path / "one"), trainer.metrics(tmp_path / "tp")
    assert len(a) == len(b) == 2 and [m["reward"] for m in a] == [m["reward"] for m in b], (a, b)
    for step in (1, 2):  # the same completions, not only rewards that happen to agree
        sample = f"completions/step-{step}.jsonl"
        assert (tmp_path / "one" / sample).read_text() == (tmp_path / "tp" / sample).read_text()
    assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a, b, strict=True)), (a, b)
    assert any(abs(m["loss"]) > 1e-4 for m in a), a  # a group with spread: a real gradient


ADD_TOOL = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''
TALLY_ENV = '''
class Tally:
    def __init__(self):
        self.notes = 0

    def reset(self, prompt, **columns):
        self.notes = 0
        return " (tally)" if prompt[-1]["content"].startswith("Add") else None

    def note(self, a: int, b: int) -> str:
        """Note a sum.

        Args:
            a: The first.
            b: The second.
        """
        self.notes += 1
        return "noted"

    def get_reward(self) -> float:
        return float(self.notes)
'''
TOOL_REWARD = """
def saw_five(prompts, completions, completion_ids, **kw):
    return [float(any(m["role"] == "tool" and m["content"] == "5" for m in c)) for c in completions]
"""


def test_tool_calling_run(trainer, tmp_path: Path) -> None:
    """objective.tools on one process, with the sampler correction on: replayed turns (a random tiny model writes no tool calls) make calls,
    the real tool runs in its child process, its results are rendered by the chat template and masked out of
    the loss, and a reward reads them. Two prompts, G = 2: a call then an answer, a call to the environment's
    method then an answer, a call to a tool that does not exist then an answer, a call whose continuation is
    not recorded: the model generates it (dtlaunch.train.objectives.rollout.Rollout._continue, within the room
    max_completion_length leaves). With objective.environment: one instance per rollout in the tools' child
    process, reset's text appended to the second prompt, its get_reward() logged under its class's name."""
    import json

    from grpo_toy import TOOL_TEMPLATE, write_byte_tokenizer

    tokenizer = write_byte_tokenizer(tmp_path / "tok", TOOL_TEMPLATE)
    (tmp_path / "tools.py").write_text(ADD_TOOL)
    (tmp_path / "rewards.py").write_text(TOOL_REWARD)
    (tmp_path / "env.py").write_text(TALLY_ENV)
    prompts = [[{"role": "user", "content": q}] for q in ("2 + 3?", "Add 2 and 3.")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def call(name: str) -> list[int]:
        return ids("<tool_call>" + json.dumps({"name": name, "arguments": {"a": 2, "b": 3}}) + "</tool_call><|im_end|>")

    rows = [
        [call("add"), ids("5<|im_end|>")],
        [call("note"), ids("5<|im_end|>")],
        [call("mul"), ids("6<|im_end|>")],
        [call("add")],  # its continuation is generated
    ]
    replay = tmp_path / "replay.jsonl"
    replay.write_text(json.dumps(rows) + "\n")
    data = ["data.kind=jsonl", f"data.path={tmp_path / 'prompts.jsonl'}", f"data.tokenizer={tokenizer}"]
    args = toy_args(
        data,
        "training.steps=1",
        "training.seq_len=192",
        "objective.max_completion_length=128",
        "objective.num_generations=2",
        "training.micro_batch=4",
        "training.global_batch=4",
        f"objective.tools=[{tmp_path / 'tools.py'}:add]",
        f"objective.rewards=[{tmp_path / 'rewards.py'}:saw_five]",
        f"objective.environment={tmp_path / 'env.py'}:Tally",
        f"debug.replay_completions={replay}",
        # The sampler correction across turns: only the generated continuation was sampled (the replayed turns'
        # tokens have no sampler log-prob), and its log-probs must sit on its own tokens.
        "objective.importance_sampling_correction=true",
        vocab=260,
    )
    run = tmp_path / "run"
    trainer.run(run, *args)
    [m] = trainer.metrics(run)
    assert 0 <= m["sampling/sampling_logp_difference/mean"] <= m["sampling/sampling_logp_difference/max"] < 1e-4, m
    assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, m
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.25
    assert m["rewards/Tally/mean"] == 0.25  # the one rollout that called note
    assert m[f"rewards/{tmp_path / 'rewards.py'}:saw_five/mean"] == 0.5 and abs(m["loss"]) > 0
    # The length counts the model's tokens: each row's turns, not the tool results between them; the last
    # row's generated continuation has 1 to the room left in max_completion_length (128) tokens.
    recorded = sum(sum(len(t) for t in r) if isinstance(r[0], list) else len(r) for r in rows)
    generated = 4 * m["completions/mean_length"] - recorded
    assert generated == int(generated) and 1 <= generated <= 128 - len(call("add")), m
    sample = [json.loads(x) for x in (run / "completions" / "step-1.jsonl").read_text().splitlines()]
    assert "{'error': 'Tool mul not found.'}" in sample[2]["completion"], sample
    assert "tool\n5" in sample[0]["completion"] and "tool\n5" in sample[3]["completion"], sample
    assert "tool\nnoted" in sample[1]["completion"] and sample[1]["rewards"]["Tally"] == 1.0, sample
    assert sample[2]["prompt"][-1]["content"] == "Add 2 and 3. (tally)" and sample[0]["prompt"] == prompts[0]
    # The summary compares the worker's counted peak with the plan less the tool process (4 GiB by default:
    # another process, which the worker's counter never sees).
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["peak_mem_bytes_planned"] < 2**30, summary
