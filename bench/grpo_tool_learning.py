"""A tiny model learns to use a tool: SFT on synthetic tool-calling transcripts, then GRPO against an
environment whose reward needs the tool's answer, on one process and on FSDP2 (2 CPU ranks, gloo).

  python bench/grpo_tool_learning.py            # writes bench/results/grpo-tool-learning-cpu.{md,json}
  python bench/grpo_tool_learning.py --tiny     # a few steps of each phase: the pipeline runs (no learning)

The task: "What is in box 37?". Every prompt's record holds a `secret` (a random 3-digit number) that is
not in the prompt; the environment (`Boxes`, TRL's environment_factory) is reset with the record and its
one method, `open(n)`, returns the secret for the asked box (another box returns another number). The
reward is 1 when the last assistant turn's text is the secret, else 0: one chance in 900 without the tool.

The SFT is deliberately partial, in two phases of a few hundred transcripts each. Phase 1 teaches how the
tool is used: every transcript calls `open` with the prompt's box and copies its result (a 4-layer model
needs some 600 steps for the copy to emerge). Phase 2 teaches it to mostly not bother: only --call-share
(0.2) of its transcripts call the tool, the others answer at once with a guessed number. The SFT model thus
calls the tool on about that share of its samples (its mean reward starts <= 0.3) but copies well when it
does, and GRPO has to learn from its own rewards that calling the tool pays. (One phase with a 20 % share
does not learn to copy within minutes: the copy signal is too rare.) GRPO's learning rate is small (5e-4):
two Adam steps at 3e-3 wrecked the SFT model (garbled calls, reward 0 from step 3 on).

The transcripts are rendered by a compact Qwen-style template (<tool_call>{json}</tool_call> in ChatML
turns, parsed by the Qwen response template dtlaunch uses) over a byte-level tokenizer whose ChatML and
<tool_call> tags are single tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>"]  # single tokens, as in Qwen's tokenizer (added, not special)

# No tool list in the prompt (the SFT set teaches the one tool); a call renders as Qwen's JSON.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ENVIRONMENT = '''
import random


class Boxes:
    """A row of boxes: the asked one holds the record's secret, the others numbers of their own."""

    def reset(self, prompt, box, secret, **record):
        self.box, self.secret = int(box), int(secret)
        return None

    def open(self, n: int) -> int:
        """Open a box and read the number inside.

        Args:
            n: The box's number.
        """
        n = int(n)
        return self.secret if n == self.box else random.Random(self.secret * 1000 + n).randint(100, 999)
'''

REWARD = '''
def answered_secret(prompts, completions, completion_ids, secret, **kwargs):
    """1 when the last assistant turn's text is the secret (what only the tool knows), else 0."""
    out = []
    for messages, s in zip(completions, secret):
        last = [m for m in messages if m["role"] == "assistant"][-1]
        out.append(float(last.get("content", "").strip() == str(s) and not last.get("tool_calls")))
    return out
'''


def question(box: int) -> str:
    return f"What is in box {box}?"


def record(rng: random.Random) -> dict:
    return {"box": rng.randint(10, 99), "secret": rng.randint(100, 999)}


def transcript(rec: dict, call: bool, rng: random.Random) -> list[dict]:
    user = {"role": "user", "content": question(rec["box"])}
    if not call:
        return [user, {"role": "assistant", "content": str(rng.randint(100, 999))}]
    fn = {"name": "open", "arguments": {"n": rec["box"]}}
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]},
        {"role": "tool", "name": "open", "content": str(rec["secret"])},
        {"role": "assistant", "content": str(rec["secret"])},
    ]


def write_task(out: Path, n_sft: int, n_prompts: int, call_share: float, seed: int = 0) -> dict[str, Path]:
    """The tokenizer (with the template), a tiny random Qwen3 in HF format, the SFT transcripts, the GRPO
    prompts, the environment and the reward function, under `out`."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    rng = random.Random(seed)
    model_dir = out / "init"
    model_dir.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(TAGS)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config) + "\n")
    vocab = tok.get_vocab_size()
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    import torch

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(model_dir)

    # Phase 1 (how the tool is used): every transcript calls it and copies its result. Phase 2 (whether to
    # use it): only call_share of them do; the others answer with a guess.
    for name, share in (("sft1", 1.0), ("sft2", call_share)):
        sft = [transcript(record(rng), rng.random() < share, rng) for _ in range(n_sft)]
        (out / f"{name}.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in sft))
    prompts = []
    for _ in range(n_prompts):
        rec = record(rng)
        prompts.append({"prompt": [{"role": "user", "content": question(rec["box"])}], **rec})
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "boxes.py").write_text(ENVIRONMENT)
    (out / "reward.py").write_text(REWARD)
    return {
        "model": model_dir,
        "sft1": out / "sft1.jsonl",
        "sft2": out / "sft2.jsonl",
        "prompts": out / "prompts.jsonl",
    }


COMMON = [
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",
    "data.kind=jsonl",
    "data.pack=false",
]


def dtlaunch(args: list[str], log: Path) -> float:
    """Runs `dtlaunch train ARGS`, its output into `log`; the wall seconds."""
    cmd = [sys.executable, "-m", "dtlaunch", "train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", PYTHONPATH=str(common.ROOT))
    t = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=common.ROOT)
    if proc.returncode:
        sys.exit(f"dtlaunch train failed (rc {proc.returncode}), see {log}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - t


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def sft(out: Path, name: str, init: Path, data: Path, steps: int, lr: float) -> tuple[Path, float]:
    """`dtlaunch train` SFT from the HF directory `init` on the transcripts `data`, exported to HF format."""
    run = out / name
    seconds = dtlaunch(
        [
            *COMMON,
            f"model.init_from=hf:{init}",
            "data.format=chat",
            f"data.path={data}",
            "training.seq_len=128",
            "training.micro_batch=16",
            "training.global_batch=16",
            f"training.steps={steps}",
            f"optim.lr={lr}",
            f"optim.warmup_steps={max(1, steps // 10)}",
            "launch.nproc_per_node=1",
            f"checkpoint.every_steps={steps}",
            f"run.dir={run}",
        ],
        out / f"{name}.log",
    )
    export = out / f"{name}-hf"
    subprocess.run(
        [sys.executable, "-m", "dtlaunch", "ckpt", "export", str(run), "--out", str(export)],
        check=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(common.ROOT)),
        cwd=common.ROOT,
    )
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not (export / f).exists():
            (export / f).write_bytes((init / f).read_bytes())
    return export, seconds


def grpo(out: Path, name: str, init: Path, task: dict, steps: int, lr: float, layout: list[str]) -> dict:
    run = out / name
    seconds = dtlaunch(
        [
            *COMMON,
            "objective=grpo",
            f"model.init_from=hf:{init}",
            "data.format=prompt",
            f"data.path={task['prompts']}",
            f"objective.environment={task['prompts'].parent / 'boxes.py'}:Boxes",
            f"objective.rewards=[{task['prompts'].parent / 'reward.py'}:answered_secret]",
            "objective.max_tool_calling_iterations=2",
            "training.seq_len=120",
            "objective.max_completion_length=80",
            "objective.num_generations=8",
            "objective.temperature=1.0",
            "training.micro_batch=16",
            "training.global_batch=32",
            f"training.steps={steps}",
            f"optim.lr={lr}",
            "optim.warmup_steps=1",
            "checkpoint.enabled=false",
            *layout,
            f"run.dir={run}",
        ],
        out / f"{name}.log",
    )
    m = metrics(run)
    rewards = [x["reward"] for x in m]
    calls = [x.get("tools/call_frequency", 0.0) for x in m]
    k = min(5, len(rewards))
    return {
        "layout": name,
        "steps": len(m),
        "reward_first": rewards[0],
        "reward_last5": sum(rewards[-k:]) / k,
        "reward_max": max(rewards),
        "call_frequency_first": calls[0],
        "call_frequency_last5": sum(calls[-k:]) / k,
        "rewards": rewards,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a few steps of each phase, no results written")
    p.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    p.add_argument("--sft-examples", type=int, default=400)
    p.add_argument("--call-share", type=float, default=0.2)
    p.add_argument("--sft1-steps", type=int, default=700)
    p.add_argument("--sft2-steps", type=int, default=150)
    p.add_argument("--sft-lr", type=float, default=1e-2)
    p.add_argument("--grpo-steps", type=int, default=30)
    p.add_argument("--grpo-lr", type=float, default=5e-4)
    p.add_argument("--layouts", default="one,fsdp2")
    p.add_argument("--reuse-sft", action="store_true", help="GRPO from the SFT models already under --out")
    a = p.parse_args()
    if a.tiny:
        a.sft_examples, a.sft1_steps, a.sft2_steps, a.grpo_steps = 32, 2, 2, 2
    import tempfile

    out = a.out or Path(tempfile.mkdtemp(prefix="grpo-tool-"))
    out.mkdir(parents=True, exist_ok=True)
    task = write_task(out, a.sft_examples, 64, a.call_share)
    if a.reuse_sft:  # the same task (seeded), the SFT runs' own wall times
        init = out / "sft2-hf"
        sft1_s, sft2_s = (metrics(out / n)[-1]["elapsed_s"] for n in ("sft1", "sft2"))
    else:
        sft1, sft1_s = sft(out, "sft1", task["model"], task["sft1"], a.sft1_steps, a.sft_lr)
        init, sft2_s = sft(out, "sft2", sft1, task["sft2"], a.sft2_steps, a.sft_lr)
    layouts = {
        "one": ["launch.nproc_per_node=1"],
        "fsdp2": ["launch.nproc_per_node=2", "strategy=fsdp"],
    }
    results = []
    for name in a.layouts.split(","):
        r = grpo(out, name, init, task, a.grpo_steps, a.grpo_lr, layouts[name])
        print(f"{name}: reward {r['reward_first']:.2f} -> {r['reward_last5']:.2f} (last 5 steps), {r['seconds']} s")
        results.append(r)
    if a.tiny:
        return
    info = common.machine_info()
    data = {"machine": info, "command": common.this_command(), "args": vars(a) | {"out": str(out)}}
    data |= {"sft1_seconds": round(sft1_s, 1), "sft2_seconds": round(sft2_s, 1), "grpo": results}
    common.write_json(common.RESULTS / "grpo-tool-learning-cpu.json", data)
    rows = [
        [
            r["layout"],
            r["steps"],
            f"{r['reward_first']:.2f}",
            f"{r['reward_last5']:.2f}",
            f"{r['call_frequency_first']:.2f}",
            f"{r['call_frequency_last5']:.2f}",
            f"{r['seconds']:.0f}",
        ]
        for r in results
    ]
    headers = ["GRPO layout", "steps", "reward step 1", "reward last 5", "calls step 1", "calls last 5", "wall s"]
    md = [
        "# A tiny model learns to use a tool (GRPO, CPU)",
        "",
        f"`{data['command']}` on {common.describe_machine(info)}.",
        "",
        f"SFT (lr {a.sft_lr}, 16 transcripts a step): phase 1, {a.sft_examples} transcripts that all call the "
        f"tool and copy its result, {a.sft1_steps} steps ({sft1_s:.0f} s); phase 2, {a.sft_examples} more of which "
        f"{a.call_share:.0%} call the tool and the others answer with a guess, {a.sft2_steps} steps "
        f"({sft2_s:.0f} s). GRPO from the SFT weights: G = 8, 4 prompts per step, lr {a.grpo_lr}. Reward: 1 "
        "when the final answer is the number the environment's tool returns for the prompt's box. "
        "'calls': tools/call_frequency (calls per completion).",
        *(
            [
                "",
                "--reuse-sft: GRPO started from the SFT models an earlier invocation (the same defaults and seed) "
                "left in --out; the SFT seconds are those runs' training time (metrics.jsonl elapsed_s).",
            ]
            if a.reuse_sft
            else []
        ),
        "",
        common.markdown_table(headers, rows),
        "",
        "Rewards per step:",
        "",
        *[f"- {r['layout']}: {', '.join(f'{x:.2f}' for x in r['rewards'])}" for r in results],
        "",
    ]
    (common.RESULTS / "grpo-tool-learning-cpu.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
