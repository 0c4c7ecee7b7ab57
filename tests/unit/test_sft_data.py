"""What supervised fine-tuning trains, record by record, as TRL's SFTTrainer trains it (docs/sft-data.md),
and the loader's batches at micro_batch=1: each check against transformers' / TRL's own tokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from dtlaunch.errors import InputError
from dtlaunch.job.model_schema import typed_job
from dtlaunch.launch.run_data import keep_tokenizer, prepare_run_data
from dtlaunch.train.data import IGNORE_INDEX, build_loaders

transformers = pytest.importorskip("transformers")

PAIRS = [("kaka lolo mimi", " nunu pepe"), ("rara sisi", " toto veve zozo"), ("baba", " dudu"), ("fefe gigi", " hoho")]
CHATS = [
    [
        {"role": "user", "content": "kaka lolo"},
        {"role": "assistant", "content": "mimi nunu"},
        {"role": "user", "content": "pepe"},
        {"role": "assistant", "content": "rara"},
    ],
    [
        {"role": "system", "content": "sisi"},
        {"role": "user", "content": "toto"},
        {"role": "assistant", "content": "veve"},
    ],
]
# The tiny tokenizer's ChatML-like template with the assistant content and end of turn in {% generation %}.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|> assistant {% generation %}"
    "{{ m['content'] }} <|im_end|> {% endgeneration %}{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
    "<|im_end|> {% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def job(tmp_path: Path, tokenizer: Path, data: Path, **over: object) -> object:
    cfg = typed_job({})
    values = {
        "model.vocab_size": 512,
        "data.kind": "jsonl",
        "data.path": str(data),
        "data.tokenizer": str(tokenizer),
        "data.cache_dir": str(tmp_path / "cache"),
        "training.seq_len": 16,
        "training.micro_batch": 1,
        "training.global_batch": 2,
        "data.pack": False,
        "launch.nproc_per_node": 1,
        **{k.replace("__", "."): v for k, v in over.items()},
    }
    for key, value in values.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepared(tmp_path: Path, cfg: object) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    prepare_run_data(cfg, run)
    return run


def hf_tok(tokenizer_dir: Path) -> object:
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_masked_data_at_micro_batch_1_keeps_its_inputs(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """The crash of issue 37: one-row targets were a view of the inputs, so -100 landed in the inputs."""
    data = write(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 3])
    for pack in (False, True):
        cfg = job(tmp_path, tiny_tokenizer / "tokenizer.json", data, data__format="prompt_completion", data__pack=pack)
        loader, _ = build_loaders(cfg, prepared(tmp_path, cfg), 0, 1)
        for _ in range(4):
            batch = loader.next_batch()
            inputs, targets = batch.inputs, batch.targets
            assert inputs.shape == (1, 16) and int(inputs.min()) >= 0, inputs
            assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
            assert inputs.untyped_storage().data_ptr() != targets.untyped_storage().data_ptr()


def test_token_ids_are_checked_in_both_directions() -> None:
    from dtlaunch.train.data import check_ids

    with pytest.raises(InputError, match=r"^data.path: token id -3 < 0"):
        check_ids(np.array([[5, -3, 2]]), 10, "data.path")
    with pytest.raises(InputError, match=r"^data.path: token id 10 >= model.vocab_size=10"):
        check_ids(np.array([[5, 10]]), 10, "data.path")
    check_ids(np.array([[0, 9]]), 10, "data.path")


def test_prompt_completion_trains_the_completion_and_eos_as_trl(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Unpacked samples hold TRL's tokenized record (prompt + completion + EOS) and its completion mask."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = write(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    cfg = job(tmp_path, tiny_tokenizer / "tokenizer.json", data, data__format="prompt_completion", data__pack=False)
    loader, _ = build_loaders(cfg, prepared(tmp_path, cfg), 0, 1)
    tok = hf_tok(tiny_tokenizer)
    ref = SFTTrainer(
        model=tiny_model(len(tok)),
        args=SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True),
        train_dataset=Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS]),
        processing_class=tok,
    ).train_dataset
    for i, row in enumerate(ref):
        sample = loader.source.sample(i)
        n = len(row["input_ids"])
        assert sample[0, :n].tolist() == row["input_ids"] and row["input_ids"][-1] == tok.eos_token_id
        assert [t if m else -100 for t, m in zip(sample[0, 1:n], sample[1, 1:n], strict=True)] == row["labels"][1:]


def tiny_model(vocab: int) -> object:
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("marked", [False, True], ids=["span", "generation_blocks"])
def test_chat_trains_assistant_content_and_end_of_turn(tmp_path: Path, tiny_tokenizer: Path, marked: bool) -> None:
    """Without {% generation %}: TRL's conversational prompt/completion mask (the last turn's content and end
    of turn, not its header). With it: exactly transformers' assistant-token mask (TRL assistant_only_loss)."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer, tok_dir)
    tok = hf_tok(tok_dir)
    if marked:
        (tok_dir / "chat_template.jinja").write_text(GENERATION_TEMPLATE)  # where save_pretrained writes it
    data = write(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    cfg = job(tmp_path, tok_dir / "tokenizer.json", data, data__format="chat", data__pack=False, training__seq_len=40)
    loader, _ = build_loaders(cfg, prepared(tmp_path, cfg), 0, 1)
    for i, messages in enumerate(CHATS):
        sample = loader.source.sample(i)
        template = GENERATION_TEMPLATE if marked else tok.chat_template
        full = tok.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked
        )
        n = len(full["input_ids"])
        assert sample[0, :n].tolist() == full["input_ids"] and sample[0, n] == tok.eos_token_id
        got = sample[1, :n].tolist()
        assert sample[1, n:].sum() == 0  # the EOS that separates documents is not a target
        if marked:
            assert got == full["assistant_masks"]
            continue
        # TRL's conversational prompt/completion: the prompt is the turns before the last with the generation
        # prompt; the completion (content + end of turn) is the rest. Earlier assistant turns train alike.
        prompt = tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)
        k = len(prompt["input_ids"])
        assert got[k:] == [1] * (n - k) and got[k - 1] == 0
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        learnt = tok.convert_ids_to_tokens([t for t, m in zip(full["input_ids"], got, strict=True) if m])
        assert learnt == [w for a in answers for w in [*a.split(), "<|im_end|>"]]


def test_a_chat_template_in_chat_template_jinja_is_read_kept_and_exported(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Issue 40's bug 1: transformers' save_pretrained writes chat_template.jinja, which dtlaunch ignored."""
    from dtlaunch.convert.hf import export_tokenizer

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    hf = hf_tok(tiny_tokenizer)
    hf.save_pretrained(tok_dir)
    assert (tok_dir / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tok_dir / "tokenizer_config.json").read_text())
    data = write(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    cfg = job(tmp_path, tok_dir / "tokenizer.json", data, data__format="chat", data__pack=False)
    run = prepared(tmp_path, cfg)
    keep_tokenizer(cfg, run)
    export_tokenizer(run / "checkpoints" / "step-00000001", tmp_path / "export")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "export").chat_template == hf.chat_template


def test_targets_are_counted_and_a_dataset_without_any_is_refused(
    tmp_path: Path, tiny_tokenizer: Path, capsys: pytest.CaptureFixture
) -> None:
    data = write(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    cfg = job(tmp_path, tiny_tokenizer / "tokenizer.json", data, data__format="prompt_completion")
    prepared(tmp_path, cfg)
    targets = sum(len(c.split()) + 1 for _, c in PAIRS)  # each completion and its EOS
    assert f"data.path: 4 prompt_completion records, {targets} target tokens" in capsys.readouterr().out
    empty = write(tmp_path / "empty.jsonl", [{"prompt": p, "completion": ""} for p, _ in PAIRS])
    chats = write(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "kaka"}]}] * 4)
    for path, fmt in ((chats, "chat"),):
        cfg = job(tmp_path, tiny_tokenizer / "tokenizer.json", path, data__format=fmt)
        with pytest.raises(InputError, match="^data.path: no record of .* has a token to learn") as err:
            prepared(tmp_path, cfg)
        assert "\n" not in str(err.value)
    # An empty completion still trains its EOS (TRL appends it): the model learns to answer nothing.
    prepared(tmp_path, job(tmp_path, tiny_tokenizer / "tokenizer.json", empty, data__format="prompt_completion"))


def test_preference_completions_end_as_trls(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Chosen / rejected rows are TRL DPOTrainer's prompt ids + completion ids: a text completion ends with
    EOS, a chat completion with its template's end of turn."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from dtlaunch.data.chat import ChatEncoder
    from dtlaunch.data.preference import PairEncoder

    tok = hf_tok(tiny_tokenizer)
    user = [{"role": "user", "content": "kaka lolo"}]
    rows = [
        {"prompt": "kaka lolo", "chosen": " mimi nunu", "rejected": " pepe"},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "mimi"}], "rejected": [{"role": "assistant", "content": "rara sisi"}]},
    ]  # fmt: skip
    encoder = PairEncoder(
        ChatEncoder(tiny_tokenizer / "tokenizer.json", np.dtype(np.uint16), chat=False), tok.eos_token_id
    )
    for row in rows:
        model = tiny_model(len(tok))
        args = DPOConfig(output_dir=str(tmp_path / "dpo"), report_to=[], use_cpu=True, bf16=False)
        data = Dataset.from_list([row])
        ref = DPOTrainer(
            model=model, ref_model=tiny_model(len(tok)), args=args, train_dataset=data, processing_class=tok
        )
        want = ref.train_dataset[0]
        ours = encoder.pair((row["prompt"], row["chosen"], row["rejected"]), "x:1", "data.path")
        for (ids, prompt_len), name in zip(ours, ("chosen", "rejected"), strict=True):
            assert ids == want["prompt_ids"] + want[f"{name}_ids"] and prompt_len == len(want["prompt_ids"])
