"""The everyday settings, each for two optimizer steps: every data format x micro_batch 1 and 2 x data.pack
true and false x objective (sft on text / prompt-completion / chat, dpo / orpo / simpo on preference pairs),
plus LoRA and QLoRA at micro_batch=1 on chat. One tiny Qwen2 directory, records prepared once per format by
the launcher's own code, the worker's loader, runtime and step in one forked process (a 1-rank group, as
`launch.nproc_per_node=1` runs it). Masked data at micro_batch=1 crashed here before (issue 37)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from forked_training import run_forked, train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason("every data format x micro-batch x packing x objective trained in one forked group"),
]
pytest.importorskip("transformers")

# Roles as words of the tiny tokenizer; each turn ends with its EOS, the end-of-turn token.
TEMPLATE = (
    "{% set names = {'system': 'w247', 'user': 'w248', 'assistant': 'w249'} %}{% for m in messages %}"
    "{{ names[m['role']] }} {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}w249 {% endif %}"
)
FORMATS = {"text": "sft", "prompt_completion": "sft", "chat": "sft", "preference": ("dpo", "orpo", "simpo")}
COMMON = ["model=tiny", "training.seq_len=24", "training.global_batch=2", "optim.warmup_steps=0", "optim.lr=1e-3"]
COMMON += ["precision=fp32", "strategy=ddp", "launch.nproc_per_node=1"]
PEFT = {"lora": ["peft=lora"], "qlora": ["peft=qlora", "peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"]}


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(f"w{rng.randint(0, 240)}" for _ in range(rng.randint(lo, hi)))


def records(fmt: str) -> list[dict]:
    rng = random.Random(fmt)
    if fmt == "text":
        return [{"text": words(rng, 6, 20)} for _ in range(16)]
    if fmt == "prompt_completion":
        return [{"prompt": words(rng, 2, 8), "completion": " " + words(rng, 1, 6)} for _ in range(16)]
    if fmt == "chat":
        turns = [[{"role": "user", "content": words(rng, 2, 6)}, {"role": "assistant", "content": words(rng, 1, 5)}]]
        return [{"messages": turns[0] * rng.randint(1, 2)} for _ in range(16)]
    return [{"prompt": words(rng, 2, 8), "chosen": words(rng, 1, 5), "rejected": words(rng, 1, 5)} for _ in range(16)]


def runs() -> dict[str, tuple[str, list[str]]]:
    """name -> (format, overrides)."""
    out = {}
    for fmt, objectives in FORMATS.items():
        for objective in (objectives,) if isinstance(objectives, str) else objectives:
            for mb in (1, 2):
                for pack in ("true", "false"):
                    over = [f"objective={objective}", f"training.micro_batch={mb}", f"data.pack={pack}"]
                    out[f"{fmt}/{objective}/mb{mb}/pack_{pack}"] = (fmt, over)
    for method, over in PEFT.items():
        out[f"chat/sft/{method}/mb1"] = ("chat", [*over, "training.micro_batch=1", "data.pack=false"])
    return out


@pytest.fixture(scope="module")
def results(tiny_hf_dirs, tmp_path_factory) -> dict:
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.run_data import prepare_run_data

    base = tmp_path_factory.mktemp("matrix")
    (base / "chat.jinja").write_text(TEMPLATE)
    plan = {}
    for name, (fmt, over) in runs().items():
        data = base / f"{fmt}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records(fmt)))
        full = [*COMMON, f"model.init_from=hf:{tiny_hf_dirs['qwen2']}", "data.kind=jsonl", f"data.path={data}"]
        full += [f"data.format={fmt}", f"data.cache_dir={base / 'cache'}", *over]
        full += [f"data.chat_template={base / 'chat.jinja'}"] if fmt == "chat" else []
        run = base / name.replace("/", "_")
        run.mkdir()
        prepare_run_data(compose(full).cfg, run)
        plan[name] = (full, run)

    def batches(run: Path):
        def make(cfg, gb, dp_rank, dp_size, cp_rank, cp_size):
            from dtlaunch.train.data import build_loaders

            return build_loaders(cfg, run, dp_rank, dp_size)[0]

        return make

    def run_all() -> dict:
        return {
            name: train(over, 1, 2, make_batches=batches(run), mesh=True)["loss"] for name, (over, run) in plan.items()
        }

    return run_forked(1, run_all, base / "results.json")


def test_every_format_micro_batch_pack_and_objective_trains(results: dict) -> None:
    assert set(results) == set(runs())
    bad = {name: losses for name, losses in results.items() if len(losses) != 2 or not all(map(math.isfinite, losses))}
    assert not bad, bad
