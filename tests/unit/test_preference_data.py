"""Preference pairs (data.format=preference) and the objective section's rules: tokenized rows, EOS after
text completions, chat rendering, the cut that keeps the prompt's end, one pair per sample, bad records
named by file and line, and the combinations validate refuses (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtlaunch.data.preference import PairSource, cut
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.launch.run_data import tokenize_records

pytest.importorskip("transformers")


def test_cut_keeps_the_prompt_end_then_the_completion_start() -> None:
    assert cut(4, 10, 12) == (0, 10)  # fits: nothing cut
    assert cut(8, 14, 12) == (2, 12)  # the prompt loses its first 2 tokens, the completion is whole
    assert cut(10, 30, 12) == (4, 12)  # a long completion: half the row keeps the prompt's end
    assert cut(3, 30, 12) == (0, 12)  # a short prompt stays whole, the completion loses its end


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def args(tok: Path, data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "objective=dpo",
        "data.kind=jsonl",
        "data.format=preference",
        f"data.path={data}",
        f"data.tokenizer={tok / 'tokenizer.json'}",
        f"data.cache_dir={cache}",
        "model.vocab_size=512",
        "training.seq_len=12",
        *extra,
    ]


def pairs_of(tiny_tokenizer: Path, tmp_path: Path, records: list, *extra: str) -> tuple[PairSource, object]:
    cfg = compose(args(tiny_tokenizer, write(tmp_path / "p.jsonl", records), tmp_path / "cache", *extra)).cfg
    validate(cfg)
    entry = tokenize_records(cfg, str(cfg.data.path), "data.path")
    return PairSource(str(entry), int(cfg.training.seq_len), "data.path"), cfg


def ids(tiny_tokenizer: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_text_pairs_end_with_eos_and_mask_only_completions(tiny_tokenizer: Path, tmp_path: Path) -> None:
    # As in TRL's datasets, a completion starts with its separator: prompt + completion is tokenized whole.
    rec = {"prompt": "kaka kalo kami", "chosen": " lolo lomi", "rejected": " nunu"}
    source, _ = pairs_of(tiny_tokenizer, tmp_path, [rec, rec])
    assert source.num_samples == 2 and source.cut_pairs() == 0
    sample = source.sample(1)
    assert sample.shape == (2, 2, 13)
    eos = ids(tiny_tokenizer, "<|endoftext|>")[0]
    prompt, chosen, rejected = (ids(tiny_tokenizer, rec[k]) for k in ("prompt", "chosen", "rejected"))
    for side, completion in ((0, chosen), (1, rejected)):
        row = prompt + completion + [eos]
        assert sample[side, 0, : len(row)].tolist() == row
        assert (sample[side, 0, len(row) :] == eos).all()  # right padding
        mask = [0] * len(prompt) + [1] * (len(completion) + 1) + [0] * (13 - len(row))
        assert sample[side, 1].tolist() == mask


def test_chat_pairs_render_the_template(tiny_tokenizer: Path, tmp_path: Path) -> None:
    rec = {
        "prompt": [{"role": "user", "content": "kaka"}],
        "chosen": [{"role": "assistant", "content": "lolo"}],
        "rejected": [{"role": "assistant", "content": "mimi nunu"}],
    }
    source, _ = pairs_of(tiny_tokenizer, tmp_path, [rec], "training.seq_len=24", "training.micro_batch=1")
    chosen = source.sample(0)[0]
    rendered = ids(tiny_tokenizer, "<|im_start|> user kaka <|im_end|> <|im_start|> assistant lolo <|im_end|>")
    assert chosen[0, : len(rendered)].tolist() == rendered
    completion = chosen[0][chosen[1] == 1].tolist()
    assert completion == ids(tiny_tokenizer, "lolo <|im_end|>")  # the template's end of turn, no extra EOS


def test_long_pairs_are_cut_and_counted(tiny_tokenizer: Path, tmp_path: Path) -> None:
    long = {"prompt": " ".join(["kaka"] * 20), "chosen": " lolo", "rejected": " mimi"}
    short = {"prompt": "kaka", "chosen": " lolo", "rejected": " mimi"}
    source, _ = pairs_of(tiny_tokenizer, tmp_path, [long, short, short, short])
    assert source.cut_pairs() == 1
    row = source.sample(0)[0]
    assert row[1, -2:].tolist() == [1, 1]  # the completion and its EOS survive at the end of the row
    assert row[1].sum() == 2


def test_a_bad_record_is_named_by_file_and_line(tiny_tokenizer: Path, tmp_path: Path) -> None:
    good = {"prompt": "kaka", "chosen": "lolo", "rejected": "mimi"}
    mixed = {"prompt": "kaka", "chosen": [{"role": "assistant", "content": "lolo"}], "rejected": "mimi"}
    with pytest.raises(InputError, match=r"p\.jsonl:3 mixes field types"):
        pairs_of(tiny_tokenizer, tmp_path, [good, good, mixed])
    with pytest.raises(InputError, match=r"p\.jsonl:2 has no field 'rejected'"):
        pairs_of(tiny_tokenizer, tmp_path, [good, {"prompt": "kaka", "chosen": "lolo"}])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.format=text"], "objective=dpo trains on preference pairs, not data.format=text"),
        (["objective=sft"], "data.format=preference holds pairs, which objective=sft cannot train on"),
        (["objective.label_smoothing=0.1"], "objective.label_smoothing=0.1 is used by objective.loss=robust only"),
        (["objective.loss=robust", "objective.label_smoothing=0.5"], "objective.label_smoothing=0.5 is out of range"),
        (["objective.beta=0"], "objective.beta=0.0 must be > 0 for objective=dpo"),
        (["objective.reference=runs/x"], "objective.reference='runs/x': no such directory"),
        (["objective.reference=hf:/nonexistent"], "holds no config.json"),
        (["objective=orpo", "objective.precompute_reference=true"], "objective=orpo uses no reference model"),
        (["training.eval_every=2", "data.val_fraction=0.5"], "validation is not computed for objective=dpo"),
    ],
)
def test_validate_refuses(tiny_tokenizer: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": "kaka", "chosen": "lolo", "rejected": "mimi"}])
    with pytest.raises(ConfigError) as err:
        validate(compose(args(tiny_tokenizer, data, tmp_path, *extra)).cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["strategy.cp=2", "launch.nproc_per_node=2", "training.seq_len=16"],
        ["model=tiny_moe", "strategy=zero3", "strategy.ep=2", "launch.nproc_per_node=2"],
        ["objective=simpo", "strategy.cp=2", "launch.nproc_per_node=2", "training.seq_len=16"],
        ["strategy=pp", "launch.nproc_per_node=2", "objective.precompute_reference=true", "model=tiny_deep"],
        ["strategy=pp", "launch.nproc_per_node=2", "model=tiny_deep"],
        ["strategy=pp", "launch.nproc_per_node=2", "model=tiny_deep", "peft=lora"],
        [
            "strategy=pp",
            "launch.nproc_per_node=2",
            "model=tiny_deep",
            "peft=lora",
            "objective.precompute_reference=true",
        ],
        ["objective=orpo", "strategy=pp", "launch.nproc_per_node=2", "model=tiny_deep"],
    ],
    ids=[
        "dpo-cp",
        "dpo-ep",
        "simpo-cp",
        "dpo-pp-precomputed",
        "dpo-pp",
        "dpo-pp-lora",
        "dpo-pp-lora-precomputed",
        "orpo-pp",
    ],
)
def test_validate_accepts_every_layout_that_runs(tiny_tokenizer: Path, tmp_path: Path, extra: list[str]) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": "kaka", "chosen": "lolo", "rejected": "mimi"}])
    cfg = compose(args(tiny_tokenizer, data, tmp_path, *extra)).cfg
    assert validate(cfg).layout.world == 2


def test_the_loader_stacks_chosen_rows_then_rejected_rows() -> None:
    from dtlaunch.train.data import TokenLoader

    class Pairs:
        num_samples = 4

        def sample(self, i: int) -> np.ndarray:
            out = np.zeros((2, 2, 5), dtype=np.int64)
            out[0, 0], out[1, 0] = 10 + i, 20 + i  # chosen ids 10+i, rejected 20+i
            out[:, 1, 2:] = 1
            return out

    loader = TokenLoader(Pairs(), 2, 4, 0, 0, 1, 64, shuffle=False)
    loader.ref_logps = np.array([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0], [4.0, -4.0]])
    batch = loader.next_batch()
    assert batch.inputs[:, 0].tolist() == [10, 11, 20, 21]
    assert batch.targets[0].tolist() == [-100, 10, 10, 10]  # prompt positions are no targets
    assert batch.ref_logps.tolist() == [1.0, 2.0, -1.0, -2.0]
