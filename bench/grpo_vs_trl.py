"""GRPO step speed against TRL's GRPOTrainer on the same job, one process on CPU.

  python bench/grpo_vs_trl.py            # writes bench/results/grpo-vs-trl-cpu.{md,json}
  python bench/grpo_vs_trl.py --steps 12 --warmup 3 --repeats 1 --no-write   # a quick look
  python bench/grpo_vs_trl.py --dtlaunch objective.generation_compile=true   # dtlaunch's compiled decode step

The job, alike on both sides: a tiny random Qwen2 (transformers' config classes, the test models' shape:
2 layers, hidden 64, 256-word vocabulary) in an HF directory both load; 64 prompts of 3 to 8 words;
G = 8 completions per prompt, 4 prompts per step (32 completions, one micro-batch), at most 8 new tokens,
temperature 1; one reward function (the share of completion words that are the prompt's first word);
beta 0, one optimizer step per generation batch, AdamW at the same learning rate.

TRL runs in this process (GRPOTrainer.train, use_cpu); dtlaunch as `dtlaunch train objective=grpo` on one
process. Both measure the same thing: the steady state, steps after the first W. A step's seconds: TRL's
between two steps' ends (a callback's clock), dtlaunch's from its metrics.jsonl (`elapsed_s`, when each
step ended). Rollout seconds: TRL's `_generate_and_score_completions` (generation, rewards, advantages) and
within it `_generate` (sampling alone); dtlaunch's `time/rollout_s` and `time/generation_s`. Generated
tokens/s: completion tokens (EOS included) over the sampling seconds. Each figure is the first quartile
of the steps' (the CPU is shared: a quiet step is one no neighbour's burst slowed), then the median over the
repeats; the ratios are the medians of each repeat's own (its two runs back to back). The mean steps/s is
kept in the JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

WORDS = [f"w{i}" for i in range(254)]
G, PROMPTS_PER_STEP, MAX_NEW, LR = 8, 4, 8, 1e-3

REWARD = '''
def first_word_share(prompts, completions, completion_ids, **kwargs):
    """The share of the completion's words that are the prompt's first word."""
    out = []
    for p, c in zip(prompts, completions):
        words = c.split()
        out.append(sum(w == p.split()[0] for w in words) / max(len(words), 1))
    return out
'''


def write_task(out: Path, n_prompts: int = 64, seed: int = 0) -> dict[str, Path]:
    """The HF model directory (weights, config, tokenizer), the prompts and the reward file under `out`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(n_prompts)]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (out / "reward.py").write_text(REWARD)
    return {"model": model_dir, "prompts": out / "prompts.jsonl", "reward": out / "reward.py"}


def trl_trainer(task: dict[str, Path], steps: int, out: Path) -> Any:
    """TRL's GRPOTrainer on the job (use_cpu, one thread, as dtlaunch's worker)."""
    import datasets
    import torch
    import transformers
    import trl

    sys.path.insert(0, str(task["reward"].parent))
    from reward import first_word_share  # the same file dtlaunch imports

    torch.set_num_threads(1)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(task["model"] / "tokenizer.json"), eos_token="<eos>", pad_token="<unk>"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    args = trl_config(out, steps, LR, G, PROMPTS_PER_STEP, max_completion_length=MAX_NEW, logging_steps=10**6)
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=[first_word_share],
        args=args,
        train_dataset=datasets.Dataset.from_list(prompt_rows(task)),
        processing_class=tok,
    )


def trl_config(out: Path, steps: int, lr: float, g: int, prompts: int, **job: Any) -> Any:
    """GRPOConfig of the races: CPU, fp32, G completions of `prompts` prompts in one micro-batch, temperature
    1, beta 0, no saving or progress bar; `job` the race's own fields (max_completion_length, ...)."""
    import trl

    return trl.GRPOConfig(
        output_dir=str(out / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=g,
        per_device_train_batch_size=g * prompts,
        gradient_accumulation_steps=1,
        temperature=1.0,
        beta=0.0,
        learning_rate=lr,
        max_steps=steps,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **job,
    )


def prompt_rows(task: dict[str, Path]) -> list[dict]:
    return [json.loads(x) for x in task["prompts"].read_text().splitlines()]


def run_trl(task: dict[str, Path], steps: int, warmup: int, out: Path) -> dict:
    """TRL's GRPOTrainer on the job in this process: steady-state steps/s, rollout and sampling seconds."""
    return timed_trl(trl_trainer(task, steps, out), steps, warmup, G * PROMPTS_PER_STEP, lambda r: sum(map(len, r[1])))[
        0
    ]


def timed_trl(trainer: Any, steps: int, warmup: int, rows: int, tokens_of: Any) -> tuple[dict, list[dict]]:
    """`trainer.train()` timed: each step's end (a callback's clock), its rollout (_generate_and_score_completions:
    generation, rewards, advantages) and sampling (_generate), and `tokens_of(_generate's result)` generated
    tokens; the steady-state figures (steady_state_of) and what TRL logged."""
    import transformers

    clock: dict[str, list[float]] = {"step_end": [], "rollout": [], "generate": [], "tokens": []}
    logged: list[dict] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            clock["step_end"].append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **k):
            logged.append(dict(logs or {}))

    trainer.add_callback(Clock())
    generate, score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts):
        t = time.perf_counter()
        result = generate(prompts)
        clock["generate"].append(time.perf_counter() - t)
        clock["tokens"].append(tokens_of(result))
        return result

    def timed_score(inputs):
        t = time.perf_counter()
        result = score(inputs)
        clock["rollout"].append(time.perf_counter() - t)
        return result

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_score
    trainer.train()
    ends = clock["step_end"]
    steady = slice(warmup, steps)
    figures = steady_state_of(
        [b - a for a, b in zip(ends[warmup - 1 : steps - 1], ends[warmup:steps], strict=True)],
        clock["rollout"][steady],
        clock["generate"][steady],
        clock["tokens"][steady],
        rows,
    )
    return figures, logged


def steady_state_of(
    step_s: list[float],
    rollout_s: list[float],
    gen_s: list[float],
    tokens: list[float],
    rows: int = G * PROMPTS_PER_STEP,
) -> dict:
    """Per-step figures at their first quartile: the CPU is shared, and a quiet step is one no neighbour's
    burst slowed (the same statistic on both sides; the mean steps/s is kept too)."""

    def quiet(values: list[float]) -> float:
        return sorted(values)[len(values) // 4]

    return {
        "steps_per_s": 1 / quiet(step_s),
        "rollout_s": quiet(rollout_s),
        "training_s": quiet([a - b for a, b in zip(step_s, rollout_s, strict=True)]),  # the rest of the step
        "generation_s": quiet(gen_s),
        "tokens_per_s": 1 / quiet([s / n for n, s in zip(tokens, gen_s, strict=True)]),
        "mean_length": sum(tokens) / (len(tokens) * rows),
        "mean_steps_per_s": len(step_s) / sum(step_s),
    }


def dtlaunch_args(task: dict[str, Path], steps: int, run: Path) -> list[str]:
    return [
        "objective=grpo",
        f"model.init_from=hf:{task['model']}",
        "data.kind=jsonl",
        "data.format=prompt",
        f"data.path={task['prompts']}",
        f"data.tokenizer={task['model'] / 'tokenizer.json'}",
        f"objective.rewards=[{task['reward']}:first_word_share]",
        "objective.tool_timeout_s=0",  # TRL calls the reward in its own process too
        f"objective.num_generations={G}",
        f"objective.max_completion_length={MAX_NEW}",
        "objective.temperature=1.0",
        "objective.beta=0.0",
        "training.seq_len=24",
        *one_process_args(steps, LR, G * PROMPTS_PER_STEP, run),
    ]


def one_process_args(steps: int, lr: float, rows: int, run: Path) -> list[str]:
    """What both races give dtlaunch alike: one process on one thread, one micro-batch of every row, no
    checkpoint, plot or tracker."""
    return [
        f"training.micro_batch={rows}",
        f"training.global_batch={rows}",
        f"training.steps={steps}",
        f"optim.lr={lr}",
        "optim.warmup_steps=1",
        "launch.nproc_per_node=1",
        "launch.threads_per_worker=1",
        "checkpoint.enabled=false",
        "training.loss_plot=false",
        "logging.trackers=[]",
        f"run.dir={run}",
    ]


def run_dtlaunch(task: dict[str, Path], steps: int, warmup: int, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """`dtlaunch train objective=grpo` on the job (`extra`: overrides after the job's own): steady-state
    steps/s and rollout numbers, from its metrics."""
    run = out / "dtlaunch"
    return timed_dtlaunch([*dtlaunch_args(task, steps, run), *extra], steps, warmup, run, G * PROMPTS_PER_STEP)[0]


def timed_dtlaunch(args: list[str], steps: int, warmup: int, run: Path, rows: int) -> tuple[dict, list[dict]]:
    """`dtlaunch train ARGS` (one process, one thread) timed from its metrics.jsonl: each step's end
    (`elapsed_s`), `time/rollout_s`, `time/generation_s`, the completions' tokens; the steady-state figures
    (steady_state_of) and every step's metrics."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(common.ROOT))
    cmd = [sys.executable, "-m", "dtlaunch", "train", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=common.ROOT)
    if proc.returncode:
        sys.exit(f"dtlaunch train failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = m[warmup:steps]
    figures = steady_state_of(
        [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(m[warmup - 1 : steps - 1], steady, strict=True)],
        [x["time/rollout_s"] for x in steady],
        [x["time/generation_s"] for x in steady],
        [x["completions/mean_length"] * rows for x in steady],
        rows,
    )
    return figures, m


def paired_ratios(runs: dict[str, list[dict]]) -> dict[str, float]:
    """dtlaunch over TRL: each repeat's two runs are back to back (the machine's load alike), so each ratio is
    the median of the repeats' own."""
    pairs = list(zip(runs["dtlaunch"], runs["trl"], strict=True))
    return {
        "steps_per_s": statistics.median(d["steps_per_s"] / t["steps_per_s"] for d, t in pairs),
        "rollout_s": statistics.median(t["rollout_s"] / d["rollout_s"] for d, t in pairs),
        "training_s": statistics.median(t["training_s"] / d["training_s"] for d, t in pairs),
        "tokens_per_s": statistics.median(d["tokens_per_s"] / t["tokens_per_s"] for d, t in pairs),
    }


def sampler_alone(task: dict[str, Path], reps: int, out: Path) -> dict:
    """TRL's sampler and dtlaunch's on the same generation batch (the first 4 prompts x G), from the same
    initial weights, alternated call by call in this thread: CPU seconds (time.thread_time), which the
    neighbours' load moves far less than wall seconds. TRL's: GRPOTrainer._generate (tokenize, transformers'
    generate, decode); dtlaunch's: generate_batch on the prompts' ids, what its rollout calls."""
    import torch

    from dtlaunch.infer.batch_generate import Sampling, generate_batch
    from dtlaunch.infer.generate import load_source, set_positions

    trainer = trl_trainer(task, 1, out)
    trainer.model.train()  # as in its training loop
    prompts = [r["prompt"] for r in prompt_rows(task)[:PROMPTS_PER_STEP] for _ in range(G)]
    ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    loaded = load_source(f"hf:{task['model']}", torch.device("cpu"))
    set_positions(loaded.model, max(len(i) for i in ids) + MAX_NEW)
    cpu: dict[str, list[float]] = {"trl": [], "dtlaunch": []}
    tokens: dict[str, list[int]] = {"trl": [], "dtlaunch": []}
    for r in range(reps + 3):  # the first 3 calls of each warm up
        t = time.thread_time()
        completions = trainer._generate(prompts)[1]
        cpu["trl"].append(time.thread_time() - t)
        tokens["trl"].append(sum(len(c) for c in completions))
        t = time.thread_time()
        gen = generate_batch(loaded.model, ids, Sampling(MAX_NEW, 1.0), [1], 0, torch.Generator().manual_seed(r))
        cpu["dtlaunch"].append(time.thread_time() - t)
        tokens["dtlaunch"].append(sum(len(c) for c in gen.completions))
    result: dict[str, Any] = {}
    for k in cpu:
        per_token = sorted(s / n for s, n in zip(cpu[k][3:], tokens[k][3:], strict=True))
        result[k] = {"cpu_ms": sorted(cpu[k][3:])[reps // 4] * 1e3, "tokens_per_cpu_s": 1 / per_token[reps // 4]}
    pairs = zip(cpu["trl"][3:], cpu["dtlaunch"][3:], strict=True)
    result["ratio"] = statistics.median(t / d for t, d in pairs)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (start-up, first calls)")
    p.add_argument("--repeats", type=int, default=5, help="each side run this many times, alternating; medians")
    p.add_argument("--sampler-calls", type=int, default=40, help="calls of each sampler alone, alternated")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument(
        "--dtlaunch",
        nargs="*",
        default=[],
        help="overrides for dtlaunch's side only (results then go to grpo-vs-trl-cpu-<overrides>.md)",
    )
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    task = write_task(out)
    runs: dict[str, list[dict]] = {"trl": [], "dtlaunch": []}
    for r in range(a.repeats):
        runs["trl"].append(run_trl(task, a.steps, a.warmup, out / f"r{r}"))
        runs["dtlaunch"].append(run_dtlaunch(task, a.steps, a.warmup, out / f"r{r}", tuple(a.dtlaunch)))
        t, d = (runs[k][-1]["steps_per_s"] for k in ("trl", "dtlaunch"))
        print(f"repeat {r}: TRL {t:.2f} steps/s, dtlaunch {d:.2f} ({d / t:.2f}x)")
    alone = sampler_alone(task, a.sampler_calls, out)
    med = {k: {f: common.stats(x[f] for x in v)["median"] for f in v[0]} for k, v in runs.items()}
    ratios = paired_ratios(runs) | {"sampler_alone_cpu": alone["ratio"]}
    import trl

    info = common.machine_info()
    data = {"machine": info, "command": common.this_command(), "trl": trl.__version__, "args": vars(a)}
    data |= {"median": med, "ratio_dtlaunch_over_trl": ratios, "sampler_alone": alone, "runs": runs}
    rows = [
        [name, f"{m['steps_per_s']:.2f}", f"{m['rollout_s'] * 1e3:.1f}", f"{m['generation_s'] * 1e3:.1f}"]
        + [f"{m['training_s'] * 1e3:.1f}", f"{m['tokens_per_s']:.0f}", f"{m['mean_length']:.2f}"]
        for name, m in (("TRL GRPOTrainer", med["trl"]), ("dtlaunch", med["dtlaunch"]))
    ]
    rows.append(
        ["dtlaunch / TRL", f"{ratios['steps_per_s']:.2f}x", f"{ratios['rollout_s']:.2f}x faster", ""]
        + [f"{ratios['training_s']:.2f}x faster", f"{ratios['tokens_per_s']:.2f}x", ""]
    )
    headers = ["", "steps/s", "rollout ms", "sampling ms", "rest of step ms", "generated tokens/s", "mean length"]
    alone_rows = [
        [name, f"{alone[k]['cpu_ms']:.1f}", f"{alone[k]['tokens_per_cpu_s']:.0f}"]
        for name, k in (("TRL GRPOTrainer._generate", "trl"), ("dtlaunch generate_batch", "dtlaunch"))
    ]
    alone_rows.append(["dtlaunch / TRL", f"{alone['ratio']:.2f}x faster", ""])
    md = [
        "# GRPO steps against TRL's GRPOTrainer (CPU, one process)",
        "",
        f"`{data['command']}` on {common.describe_machine(info)}; TRL {trl.__version__}.",
        "",
        f"A tiny random Qwen2 (2 layers, hidden 64, vocabulary 256); {PROMPTS_PER_STEP} prompts x G = {G} = "
        f"{G * PROMPTS_PER_STEP} completions of at most {MAX_NEW} tokens per step, temperature 1, beta 0, one "
        f"reward function; {a.steps} steps, the first {a.warmup} left out."
        + (f" dtlaunch's side with `{' '.join(a.dtlaunch)}`." if a.dtlaunch else ""),
        "",
        "## Training runs (wall clock)",
        "",
        "Per step: rollout = generation + rewards + advantages; sampling = generation alone; rest = the step "
        "less its rollout (forward, backward, optimizer, logging). Each figure is the first quartile of the "
        f"steps' (a quiet step), then the median of {a.repeats} runs of each; each ratio the median of the "
        "repeats' own (a repeat's two runs back to back, under the same load of the shared machine).",
        "",
        common.markdown_table(headers, rows),
        "",
        "## The samplers alone (CPU time, interleaved)",
        "",
        f"One generation batch ({G * PROMPTS_PER_STEP} rows) from the initial weights, the two samplers called "
        f"alternately {a.sampler_calls} times each in one thread; CPU milliseconds per call (first quartile), "
        "generated tokens per CPU second, and the median of the calls' pairwise ratios.",
        "",
        common.markdown_table(["", "CPU ms per batch", "tokens per CPU s"], alone_rows),
        "",
    ]
    print("\n".join(md))
    if not a.no_write:
        name = "grpo-vs-trl-cpu" + "".join("-" + o.rsplit(".", 1)[-1].replace("=", "-") for o in a.dtlaunch)
        common.write_json(common.RESULTS / f"{name}.json", data)
        (common.RESULTS / f"{name}.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
