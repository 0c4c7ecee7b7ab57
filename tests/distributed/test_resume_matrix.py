"""A run SIGKILLed after a checkpoint and started again with the same command resumes bit for bit, for
each kind of model entry: tied and untied embeddings, native and hf_auto families, dense and MoE, full
training, LoRA and QLoRA, SFT, DPO and GRPO.

Each start is the launcher's half of `dtlaunch train` in the test process (`prepare_launch`: compose,
plan, run directory, data, and the resume check against the checkpoint, dtlaunch.launch.preflight) and
then the worker's entry point (`dtlaunch.train.main.main`, a world of one) in a child forked from it:
the worker of a `launch.nproc_per_node=1` run, without torchrun's ~5 CPU-seconds of imports per start.

Per row: an uninterrupted run of 4 steps; a run whose worker SIGKILLs itself before step 3
(`debug.fail_mode=sigkill`), after the step-2 checkpoint; then the same command again (less the fault),
which must pass the resume check and resume from step 2. metrics.jsonl's losses are compared exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = [
    f"training.steps={STEPS}",
    "checkpoint.enabled=true",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
    "launch.nproc_per_node=1",
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    # One window per step: the killed attempt's metrics end exactly at its checkpoint.
    "training.sync_interval_s=0",
]
KILL = ["debug.fail_at_step=3", "debug.fail_rank=0", "debug.fail_mode=sigkill"]
TINY = ["model=tiny", "training.seq_len=16", "training.micro_batch=2", "training.global_batch=4", "data=synthetic"]
WORDS = [f"w{i}" for i in range(250)]


def start(overrides: list[str], run_dir: Path) -> int:
    """One `dtlaunch train` start: the launcher's preparation here, the worker in a forked child. Returns
    the worker's exit code (-9: SIGKILLed); a refusal of the launcher (its resume check) raises here."""
    from dtlaunch.commands.train import prepare_launch
    from dtlaunch.launch.local import worker_env

    prepared = prepare_launch([*overrides, f"run.dir={run_dir}"], [], force=False, no_resume=False)
    os.close(prepared.lock_fd)
    env = worker_env(prepared.cfg, run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker: its own exit (shutdown) is os._exit
        try:
            os.environ.update(env)
            import torch

            from dtlaunch.train.main import main

            torch.set_num_threads(1)
            main()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every metrics line, in the order written (a restart appends)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def log_tail(run_dir: Path) -> str:
    return (run_dir / "logs" / "rank0.log").read_text()[-3000:]


def _hf_dir(path: Path, tied: bool) -> Path:
    """A tiny random-weight Qwen2 directory (transformers' config class and save_pretrained) with a
    word-level tokenizer over w0..w249."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers = pytest.importorskip("transformers")
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
        tie_word_embeddings=tied,
    )
    torch.manual_seed(300 + tied)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", autouse=True)
def worker_imports() -> None:
    """What every worker imports, imported once here before the first fork (~3 CPU-seconds that each
    forked worker would otherwise spend again: torch._dynamo, which torch's disable-dynamo wrappers import
    on first call, and DCP)."""
    import importlib

    for module in (
        "dtlaunch.train.main",
        "dtlaunch.train.checkpoint.manager",
        "dtlaunch.convert.dcp_planner",
        "torch._dynamo",
        "torch.distributed.checkpoint.state_dict",
    ):
        importlib.import_module(module)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tied and untied tiny Qwen2 directories, preference pairs over their words, GRPO toy prompts."""
    import random

    from grpo_toy import write_tokenizer

    base = tmp_path_factory.mktemp("resume_inputs")
    out = {"qwen2_tied": _hf_dir(base / "qwen2_tied", True), "qwen2": _hf_dir(base / "qwen2", False)}
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    pairs = [{"prompt": words(3, 8), "chosen": words(2, 6), "rejected": words(2, 6)} for _ in range(32)]
    out["pairs"] = base / "pairs.jsonl"
    out["pairs"].write_text("".join(json.dumps(r) + "\n" for r in pairs))
    out["grpo_tokenizer"] = write_tokenizer(base / "grpo_tokenizer.json")
    prompts = [f"{a} {b}" for a in ("the", "a", "is", "copy") for b in ("the", "a")]
    out["prompts"] = base / "prompts.jsonl"
    out["prompts"].write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in prompts))
    return out


def hf(name: str, *extra: str, data: tuple[str, ...] = ("data=synthetic",)) -> list[str]:
    """A run from the tiny Qwen2 directory `name` of `inputs`."""
    shape = ["training.seq_len=16", "training.micro_batch=2", "training.global_batch=4"]
    return [f"model.init_from=hf:{{{name}}}", *shape, *data, *extra]


# id -> overrides ({name}: a path from `inputs`; {cache}: the test's own data cache). LoRA and QLoRA
# rows are native only: peft refuses model.arch=hf_auto (dtlaunch.job.rules.peft).
ROWS = {
    "native_tied_sft": [*TINY, "model.tie_embeddings=true"],
    "native_untied_sft": TINY,
    "native_qwen2_tied_sft": hf("qwen2_tied"),
    "hf_auto_tied_sft": hf("qwen2_tied", "model.arch=hf_auto"),
    "hf_auto_untied_sft": hf("qwen2", "model.arch=hf_auto"),
    "native_qwen2_tied_lora": hf("qwen2_tied", "peft=lora", "optim.lr=1e-2"),
    "native_qwen2_untied_lora": hf("qwen2", "peft=lora", "optim.lr=1e-2"),
    # NF4 blocks that the tiny shapes (k/v 32 x 64) hold whole.
    "native_qwen2_tied_qlora": hf(
        "qwen2_tied", "peft=qlora", "peft.nf4_block_size=32", "peft.nf4_scaler_block_size=32", "optim.lr=1e-2"
    ),
    # With the auxiliary-loss-free balancing: the routers' expert_bias buffers are saved and resumed too.
    "native_moe_tied_sft": [
        "model=tiny_moe",
        *TINY[1:],
        "model.tie_embeddings=true",
        "model.moe.bias_update_rate=0.001",
    ],
    "native_qwen2_tied_dpo": hf(
        "qwen2_tied",
        "objective=dpo",
        data=("data.kind=jsonl", "data.format=preference", "data.path={pairs}", "data.cache_dir={cache}"),
    ),
    "native_tied_grpo": [
        "model=tiny",
        "model.tie_embeddings=true",
        "model.vocab_size=16",
        "objective=grpo",
        "data.kind=jsonl",
        "data.format=prompt",
        "data.path={prompts}",
        "data.tokenizer={grpo_tokenizer}",
        "training.seq_len=8",
        "objective.max_completion_length=2",
        "objective.num_generations=8",
        "training.micro_batch=16",
        "training.global_batch=32",
        "optim.lr=1e-2",
    ],
}


@pytest.mark.parametrize("row", list(ROWS))
def test_sigkilled_run_resumes_bit_identical(row: str, inputs: dict[str, Path], tmp_path: Path) -> None:
    args = [a.format(**inputs, cache=tmp_path / "cache") for a in ROWS[row]] + COMMON
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert start(args, straight) == 0, log_tail(straight)
    want = losses(straight)
    assert [s for s, _ in want] == list(range(1, STEPS + 1)), want

    assert start([*args, *KILL], killed) == -signal.SIGKILL, log_tail(killed)
    assert (killed / "checkpoints" / "step-00000002" / "COMPLETE.json").is_file()
    # Same command again (the test's fault left out): the launcher's resume check passes and the worker
    # resumes from step 2, so steps 3 and 4 follow 1 and 2 once.
    assert start(args, killed) == 0, log_tail(killed)
    got = losses(killed)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), got
    assert got == want  # exact floats
