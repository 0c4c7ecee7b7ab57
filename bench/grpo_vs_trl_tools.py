"""Multi-turn GRPO steps (the model calls a tool, reads its result, answers) against TRL's GRPOTrainer with
`tools=` on the same job, one process on CPU.

  python bench/grpo_vs_trl_tools.py            # writes bench/results/grpo-vs-trl-tools-cpu.{md,json}
  python bench/grpo_vs_trl_tools.py --steps 8 --warmup 2 --repeats 1 --no-write   # a quick look

The job, alike on both sides: "What is in box 37?"; one tool, `open_box(n) -> int`, and one reward (1 when
the last assistant turn says what the tool returns for the prompt's box, 0.5 for calling the tool). Qwen2.5's chat template (TRL's
copy, which TRL parses tool calls with) renders the tool's JSON schema into the system turn, over a byte
tokenizer (every character a token, ChatML's tags single tokens): prompts of ~760 tokens, as real
tool-calling prompts are long. The model, a tiny Qwen2 (2 layers, hidden 64), is first fine-tuned here with
a plain transformers loop on transcripts that call the tool and copy its result, so that both trainers'
rollouts make real calls: two turns per completion on most rows (the tables give each side's calls per
completion). G = 8 completions of 4 prompts per step, at most 160 completion tokens (assistant and tool
tokens, as TRL counts them), two tool-calling iterations, temperature 1, beta 0, AdamW at 1e-5.

dtlaunch runs as users run it: the tool and the reward in its guarded child process (objective.tool_timeout_s
default), where TRL calls them in its own process. Steps/s, rollout and the rest of the step are measured as
bench/grpo_vs_trl.py measures them (first quartile of the steady steps, median over the repeats, each ratio
the median of the repeats' own).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.grpo_vs_trl import one_process_args, paired_ratios, timed_dtlaunch, timed_trl, trl_config  # noqa: E402

# A small learning rate: the SFT model is fragile (at 1e-3 its calls fall from 0.9 to 0.1 of the completions
# within the race), and the race is of speed on rollouts that keep calling the tool.
G, PROMPTS_PER_STEP, MAX_COMPLETION, SEQ_LEN, LR, ITERATIONS = 8, 4, 160, 960, 1e-5, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TOOLS = '''
def open_box(n: int) -> int:
    """Open a box and read the number inside.

    Args:
        n: The box's number.
    """
    return (int(n) * 37) % 900 + 100
'''

REWARD = '''
def answered(prompts, completions, completion_ids, box, **kwargs):
    """0.5 for calling the tool, 1 more when the last assistant turn's text is the number in the prompt's box
    (what only the tool knows)."""
    out = []
    for messages, b in zip(completions, box):
        last = [m for m in messages if m["role"] == "assistant"][-1]
        called = any(m["role"] == "tool" for m in messages)
        right = (last.get("content") or "").strip() == str((int(b) * 37) % 900 + 100)
        out.append(0.5 * called + float(right))
    return out
'''


def question(box: int) -> list[dict]:
    return [{"role": "user", "content": f"What is in box {box}?"}]


def transcript(box: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "open_box", "arguments": {"n": box}}}
    answer = str((box * 37) % 900 + 100)
    return [
        *question(box),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "open_box", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def write_task(out: Path, sft_steps: int, seed: int = 0) -> dict[str, Any]:
    """The byte tokenizer with Qwen2.5's template, the tool and reward files, the prompts, and the tiny Qwen2
    fine-tuned to call the tool (HF directory), under `out`."""
    import torch
    import transformers
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "chat_template.jinja").write_text(template)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config) + "\n")
    (out / "tools.py").write_text(TOOLS)
    (out / "reward.py").write_text(REWARD)
    rng = random.Random(seed)
    rows = [{"prompt": question(b), "box": b} for b in (rng.randint(10, 99) for _ in range(64))]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
    open_box = _load(out / "tools.py", "open_box")
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    sft_seconds = _fine_tune(model, hf_tok, open_box, sft_steps, rng)
    model.save_pretrained(model_dir)
    return {
        "model": model_dir,
        "tools": out / "tools.py",
        "reward": out / "reward.py",
        "prompts": out / "prompts.jsonl",
        "template": template,
        "sft_seconds": sft_seconds,
    }


def _load(path: Path, name: str) -> Any:
    scope: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope[name]


def _fine_tune(model: Any, tok: Any, open_box: Any, steps: int, rng: random.Random) -> float:
    """A plain transformers loop on rendered transcripts (every token trained): the model learns to call the
    tool and copy its answer, so the race's rollouts have two turns."""
    import torch

    began = time.monotonic()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        texts = [
            tok.apply_chat_template(transcript(rng.randint(10, 99)), tools=[open_box], tokenize=False)
            for _ in range(16)
        ]
        batch = tok(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            print(f"sft step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    return time.monotonic() - began


def trl_trainer(task: dict[str, Any], steps: int, out: Path) -> Any:
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(1)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(task["model"] / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=task["template"],
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    job = {"max_completion_length": MAX_COMPLETION, "max_tool_calling_iterations": ITERATIONS, "logging_steps": 1}
    args = trl_config(out, steps, LR, G, PROMPTS_PER_STEP, **job)
    rows = [json.loads(x) for x in task["prompts"].read_text().splitlines()]
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=[_load(task["reward"], "answered")],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        tools=[_load(task["tools"], "open_box")],
    )


def run_trl(task: dict[str, Any], steps: int, warmup: int, out: Path) -> dict:
    """TRL's run timed; the model's tokens (tool_mask 1), as dtlaunch's completions/mean_length counts them."""

    def model_tokens(result: Any) -> int:
        tool_mask = result[2]
        return sum(map(sum, tool_mask)) if tool_mask is not None else sum(map(len, result[1]))

    figures, logged = timed_trl(trl_trainer(task, steps, out), steps, warmup, G * PROMPTS_PER_STEP, model_tokens)
    calls = [x["tools/call_frequency"] for x in logged if "tools/call_frequency" in x]
    rewards = [x["reward"] for x in logged if "reward" in x]
    return figures | {"calls_per_completion": statistics.mean(calls), "mean_reward": statistics.mean(rewards)}


def dtlaunch_args(task: dict[str, Any], steps: int, run: Path) -> list[str]:
    return [
        "objective=grpo",
        f"model.init_from=hf:{task['model']}",
        "data.kind=jsonl",
        "data.format=prompt",
        f"data.path={task['prompts']}",
        f"objective.tools=[{task['tools']}:open_box]",
        f"objective.rewards=[{task['reward']}:answered]",
        f"objective.max_tool_calling_iterations={ITERATIONS}",
        f"objective.num_generations={G}",
        f"objective.max_completion_length={MAX_COMPLETION}",
        "objective.temperature=1.0",
        "objective.beta=0.0",
        f"training.seq_len={SEQ_LEN}",
        *one_process_args(steps, LR, G * PROMPTS_PER_STEP, run),
    ]


def run_dtlaunch(task: dict[str, Any], steps: int, warmup: int, out: Path) -> dict:
    run = out / "dtlaunch"
    figures, m = timed_dtlaunch(dtlaunch_args(task, steps, run), steps, warmup, run, G * PROMPTS_PER_STEP)
    calls = statistics.mean(x.get("tools/call_frequency", 0.0) for x in m)
    return figures | {"calls_per_completion": calls, "mean_reward": statistics.mean(x["reward"] for x in m)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing (start-up, first calls)")
    p.add_argument("--repeats", type=int, default=5, help="each side run this many times, alternating; medians")
    p.add_argument("--sft-steps", type=int, default=300, help="steps of the fine-tune that teaches the tool call")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-tools-"))
    task = write_task(out, a.sft_steps)
    runs: dict[str, list[dict]] = {"trl": [], "dtlaunch": []}
    for r in range(a.repeats):
        runs["trl"].append(run_trl(task, a.steps, a.warmup, out / f"r{r}"))
        runs["dtlaunch"].append(run_dtlaunch(task, a.steps, a.warmup, out / f"r{r}"))
        t, d = (runs[k][-1] for k in ("trl", "dtlaunch"))
        print(
            f"repeat {r}: TRL {t['steps_per_s']:.2f} steps/s ({t['calls_per_completion']:.2f} calls), "
            f"dtlaunch {d['steps_per_s']:.2f} ({d['calls_per_completion']:.2f} calls), "
            f"{d['steps_per_s'] / t['steps_per_s']:.2f}x",
            flush=True,
        )
    med = {k: {f: common.stats(x[f] for x in v)["median"] for f in v[0]} for k, v in runs.items()}
    ratios = paired_ratios(runs)
    import trl

    info = common.machine_info()
    data = {"machine": info, "command": common.this_command(), "trl": trl.__version__, "args": vars(a)}
    data |= {"sft_seconds": task["sft_seconds"], "median": med, "ratio_dtlaunch_over_trl": ratios, "runs": runs}
    rows = [
        [name, f"{m['steps_per_s']:.2f}", f"{m['rollout_s'] * 1e3:.0f}", f"{m['generation_s'] * 1e3:.0f}"]
        + [f"{m['training_s'] * 1e3:.0f}", f"{m['tokens_per_s']:.0f}", f"{m['mean_length']:.1f}"]
        + [f"{m['calls_per_completion']:.2f}", f"{m['mean_reward']:.2f}"]
        for name, m in (("TRL GRPOTrainer", med["trl"]), ("dtlaunch", med["dtlaunch"]))
    ]
    rows.append(
        ["dtlaunch / TRL", f"{ratios['steps_per_s']:.2f}x", f"{ratios['rollout_s']:.2f}x faster", ""]
        + [f"{ratios['training_s']:.2f}x faster", f"{ratios['tokens_per_s']:.2f}x", "", "", ""]
    )
    headers = ["", "steps/s", "rollout ms", "sampling ms", "rest of step ms", "model tokens/s", "model tokens"]
    headers += ["calls per completion", "mean reward"]
    md = [
        "# Multi-turn GRPO steps (tool calls) against TRL's GRPOTrainer (CPU, one process)",
        "",
        f"`{data['command']}` on {common.describe_machine(info)}; TRL {trl.__version__}.",
        "",
        f"A tiny Qwen2 (2 layers, hidden 64, byte tokenizer, Qwen2.5's chat template with the tool's schema: "
        f"~760-token prompts), fine-tuned for {a.sft_steps} steps ({task['sft_seconds']:.0f} s) to call the "
        f"tool; {PROMPTS_PER_STEP} prompts x G = {G} completions per step, at most {MAX_COMPLETION} completion "
        f"tokens, {ITERATIONS} tool-calling iterations, temperature 1, beta 0, one reward function; {a.steps} "
        f"steps, the first {a.warmup} left out. dtlaunch runs the tool and the reward in its guarded child "
        "process (its default), TRL in its own process.",
        "",
        "Per step: rollout = every turn's generation, the tool calls, rewards and advantages; sampling = the "
        "generation and the tool calls; rest = the step less its rollout. Each figure is the first quartile of "
        f"the steps', then the median of {a.repeats} runs of each; each ratio the median of the repeats' own. "
        "Model tokens: the completions' tokens the model wrote (not the tool results'). The fine-tune teaches "
        "the call, not yet the copy of its result: the rewards are mostly the call's 0.5, on both sides alike "
        "(the race is of speed, on rollouts that call the tool as often).",
        "",
        common.markdown_table(headers, rows),
        "",
    ]
    print("\n".join(md))
    if not a.no_write:
        common.write_json(common.RESULTS / "grpo-vs-trl-tools-cpu.json", data)
        (common.RESULTS / "grpo-vs-trl-tools-cpu.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
