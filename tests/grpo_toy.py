"""The toy GRPO task the CLI tests share (tests/e2e/test_grpo_cli.py, tests/e2e/test_hub_cli.py): a
16-word vocabulary, short prompts, two-token completions; each test names its own prompt data."""

from __future__ import annotations

from pathlib import Path

WORDS = ["<pad>", "<eos>", "copy", *[str(d) for d in range(10)], "the", "a", "is"]


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json over WORDS at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def toy_args(data: list[str], *extra: str) -> list[str]:
    """`dtlaunch train` overrides of the toy task on one process, reading the prompts `data` names."""
    return [
        "model.vocab_size=16",
        "objective=grpo",
        "data.format=prompt",
        *data,
        "training.seq_len=8",
        "objective.max_completion_length=2",
        "objective.num_generations=8",
        "training.micro_batch=16",
        "training.global_batch=32",
        "launch.nproc_per_node=1",
        *extra,
    ]
