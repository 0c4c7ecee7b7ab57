"""Supervised fine-tuning against TRL's SFTTrainer itself: the same tiny Qwen2 directory, the same records,
the same hyper-parameters (AdamW betas / eps, no weight decay, constant learning rate, clipping at 1, the
same global batch), TRL's tokenization, collator and loss on its side; per-step fp32 losses within 1e-5.

dtlaunch's side is the real data path (the launcher's prepare_run_data into the token cache, the worker's
loader with its global sample order and target weights) and the worker's runtime and step, in gloo workers
forked from pytest (forked_training): one process (a 1-rank group, as `launch.nproc_per_node=1`) at
micro_batch 1 and 2 with gradient accumulation, and DDP(2) / FSDP2(2). TRL runs once per case on one
process with the same global batch, reading its records in dtlaunch's sample order (sequential sampler).

Packing differs by design: TRL's packers ("bfd" / "wrapped") cut documents differently from dtlaunch's
fixed windows over the stream of documents each followed by EOS. For the packed cases TRL tokenizes the
records itself (its add-EOS and completion mask), and is handed dtlaunch's windows of that token stream
(pre-tokenized input_ids + labels, which TRL trains as they are), so both sides see the same tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from forked_training import run_forked, train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason(
        "TRL's SFTTrainer (transformers' training stack) is the reference, run once per setting the tests share"
    ),
]
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS = 5
SEQ = 48  # every record fits: no truncation on either side
GLOBAL = 4
SPECIALS = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = [f"w{i}" for i in range(500)] + ["user", "assistant", "system"]
CHAT = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# The same rendering, the assistant's content and end of turn marked for training.
CHAT_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|> assistant {% generation %}"
    "{{ m['content'] }} <|im_end|> {% endgeneration %}{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
    "<|im_end|> {% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
HYPER = ["optim.lr=3e-3", "optim.weight_decay=0", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8"]
HYPER += ["optim.warmup_steps=0", "optim.schedule=constant", "training.grad_clip=1.0", "precision=fp32"]
# case: (data.format, data.pack, chat template or "")
CASES = {
    "text_packed": ("text", True, ""),
    "text_padded": ("text", False, ""),
    "prompt_completion_padded": ("prompt_completion", False, ""),
    "prompt_completion_packed": ("prompt_completion", True, ""),
    "chat_padded": ("chat", False, CHAT),
    "chat_generation_padded": ("chat", False, CHAT_MARKED),
}
# layout: (overrides, world); micro_batch 1 x 4 accumulation steps, 2 x 2, and two data-parallel layouts.
LAYOUTS = {
    "1proc_mb1": (["strategy=ddp", "training.micro_batch=1"], 1),
    "1proc_mb2": (["strategy=ddp", "training.micro_batch=2"], 1),
    "ddp2_mb1": (["strategy=ddp", "training.micro_batch=1"], 2),
    "fsdp2_mb1": (["strategy=fsdp", "training.micro_batch=1"], 2),
}
# Which cases each layout runs (every case on one process; the data-parallel layouts on a spread of them).
RUNS = {
    "1proc_mb1": list(CASES),
    "1proc_mb2": ["text_packed", "prompt_completion_padded", "chat_generation_padded"],
    "ddp2_mb1": ["text_padded", "prompt_completion_packed", "chat_padded"],
    "fsdp2_mb1": ["prompt_completion_padded", "chat_generation_padded", "text_packed"],
}


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS[:500]) for _ in range(rng.randint(lo, hi)))


def records(fmt: str) -> list[dict]:
    """24 records of different lengths, fixed per format."""
    rng = random.Random(fmt)
    if fmt == "text":
        return [{"text": words(rng, 8, 30)} for _ in range(24)]
    if fmt == "prompt_completion":  # the completion's leading space: prompt + completion is one text (TRL)
        return [{"prompt": words(rng, 3, 12), "completion": " " + words(rng, 2, 12)} for _ in range(24)]
    out = []
    for i in range(24):
        turns = [{"role": "system", "content": words(rng, 1, 3)}] if i % 3 == 0 else []
        turns += [{"role": "user", "content": words(rng, 2, 8)}, {"role": "assistant", "content": words(rng, 1, 8)}]
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with a word-level tokenizer (~500 words, `</s>` EOS) saved by transformers."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("sft_qwen2")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT
    fast.save_pretrained(path)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, eos_token_id=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


def hf_tokenizer(model_dir: Path):
    """TRL's processing class: the directory's tokenizer.json as the fast tokenizer it is (AutoTokenizer
    would rebuild it as Qwen2's byte-level BPE from config.json's family)."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="</s>", unk_token="<unk>", chat_template=CHAT
    )


def overrides(model_dir: Path, data: Path, cache: Path, case: str, layout: str) -> list[str]:
    fmt, pack, template = CASES[case]
    over = ["model=tiny", f"model.init_from=hf:{model_dir}", "data.kind=jsonl", f"data.path={data}"]
    over += [f"data.format={fmt}", f"data.pack={str(pack).lower()}", f"data.cache_dir={cache}"]
    if template:
        chat_file = data.with_suffix(".jinja")
        chat_file.write_text(template)
        over.append(f"data.chat_template={chat_file}")
    world = LAYOUTS[layout][1]
    over += [f"training.seq_len={SEQ}", f"training.global_batch={GLOBAL}", "training.seed=3", *HYPER]
    return over + [f"launch.nproc_per_node={world}", *LAYOUTS[layout][0]]


@pytest.fixture(scope="module")
def prepared(model_dir: Path, tmp_path_factory) -> dict:
    """Each case's records, prepared once by the launcher's own code: case -> (overrides by layout, run dir)."""
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.run_data import prepare_run_data

    base = tmp_path_factory.mktemp("sft_cases")
    out = {}
    for case, (fmt, _, _) in CASES.items():
        data = base / f"{case}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records(fmt)))
        over = {layout: overrides(model_dir, data, base / "cache", case, layout) for layout in LAYOUTS}
        run = base / case
        run.mkdir()
        prepare_run_data(compose(over["1proc_mb1"]).cfg, run)
        out[case] = (over, run)
    return out


def loader_batches(run: Path):
    def make(cfg, gb, dp_rank, dp_size, cp_rank, cp_size):
        from dtlaunch.train.data import build_loaders

        return build_loaders(cfg, run, dp_rank, dp_size)[0]

    return make


@pytest.fixture(scope="module")
def ours(prepared: dict, tmp_path_factory) -> dict:
    """layout -> case -> per-step losses: one forked group per world size, every run of that size in it."""
    results: dict = {}
    for world in (1, 2):
        layouts = [name for name, (_, w) in LAYOUTS.items() if w == world]

        def run_all(layouts=layouts, world=world) -> dict:
            return {
                f"{layout}/{case}": train(
                    prepared[case][0][layout], world, STEPS, make_batches=loader_batches(prepared[case][1]), mesh=True
                )["loss"]
                for layout in layouts
                for case in RUNS[layout]
            }

        results.update(run_forked(world, run_all, tmp_path_factory.mktemp(f"sft_{world}") / "results.json"))
    return results


def sample_order(prepared_case: tuple) -> list[int]:
    """The sample indices dtlaunch's loader reads over STEPS global batches, in order."""
    from dtlaunch.job.compose import compose
    from dtlaunch.train.data import build_loaders

    over, run = prepared_case
    cfg = compose(over["1proc_mb1"]).cfg
    cfg.training.micro_batch = GLOBAL  # one process reading whole global batches: the global order
    loader = build_loaders(cfg, run, 0, 1)[0]
    return [i for _ in range(STEPS) for i in loader.next_indices()]


def trl_dataset(case: str, tokenizer, order: list[int], model_dir: Path, out: Path):
    """TRL's own records (padded cases), or dtlaunch's windows of TRL's own token stream (packed cases)."""
    fmt, pack, template = CASES[case]
    rows = records(fmt)
    if fmt == "chat" and template == CHAT:
        # No {% generation %} blocks: TRL trains a conversation's completion as conversational
        # prompt/completion data (the assistant turn after the generation prompt).
        rows = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
    if not pack:
        return datasets.Dataset.from_list([rows[i] for i in order])
    tokenized = sft_trainer(tokenizer, datasets.Dataset.from_list(rows), model_dir, out, steps=1).train_dataset
    ids = [t for r in tokenized for t in r["input_ids"]]
    labels = [t for r in tokenized for t in r["labels"]]
    windows = [(ids[i * SEQ : i * SEQ + SEQ + 1], labels[i * SEQ : i * SEQ + SEQ + 1]) for i in order]
    return datasets.Dataset.from_list([{"input_ids": w, "labels": lab} for w, lab in windows])


def sft_trainer(tokenizer, dataset, model_dir: Path, out: Path, steps: int = STEPS, micro_batch: int = 1, **kw):
    import torch

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.SFTConfig(
        output_dir=str(out), report_to=[], use_cpu=True, max_steps=steps, logging_steps=1, save_strategy="no",
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=GLOBAL // micro_batch,
        learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, train_sampling_strategy="sequential",
        max_length=None, dataloader_num_workers=0, seed=0, bf16=False, fp16=False, **kw,  # SFTConfig defaults to bf16
    )  # fmt: skip
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.fixture(scope="module")
def trl_losses(prepared: dict, model_dir: Path, tmp_path_factory) -> dict:
    """case -> TRL's per-step losses (one process, micro_batch 1, GLOBAL accumulation steps), once per case."""
    cache: dict = {}

    def get(case: str) -> list[float]:
        if case not in cache:
            _, _, template = CASES[case]
            tokenizer = hf_tokenizer(model_dir)
            out = tmp_path_factory.mktemp(f"trl_{case}")
            dataset = trl_dataset(case, tokenizer, sample_order(prepared[case]), model_dir, out)
            kw = {"assistant_only_loss": True} if template == CHAT_MARKED else {}
            if template == CHAT_MARKED:
                tokenizer.chat_template = CHAT_MARKED
            trainer = sft_trainer(tokenizer, dataset, model_dir, out, **kw)
            trainer.train()
            cache[case] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return cache[case]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_step_losses_equal_trl_sft_trainer(layout: str, ours: dict, trl_losses) -> None:
    for case in RUNS[layout]:
        got, ref = ours[f"{layout}/{case}"], trl_losses(case)
        assert len(got) == len(ref) == STEPS, (case, got, ref)
        assert ref[-1] < ref[0], (case, ref)  # the updates really move the loss
        diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        print(f"{case:26s} {layout:10s} max|dloss|={diff:.2e}")  # the report's table (pytest -s)
        assert diff <= 1e-5, (case, layout, got, ref)
