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


def toy_args(data: list[str], *extra: str, vocab: int = 16) -> list[str]:
    """`dtlaunch train` overrides of the toy task on one process, reading the prompts `data` names."""
    return [
        f"model.vocab_size={vocab}",
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


CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_byte_tokenizer(out: Path, chat_template: str) -> Path:
    """A byte-level tokenizer (one id per byte, no merges: any text round-trips, JSON tool calls included)
    with ChatML's special tokens after the 256 bytes, `chat_template` beside it (chat_template.jinja) and
    <|im_end|> as its EOS: a Qwen-style chat tokenizer for tool-calling tests. Returns tokenizer.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CHAT_SPECIALS)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(chat_template)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config) + "\n")
    return out / "tokenizer.json"


# A compact Qwen-style tool-calling template (the tool calls as <tool_call>{json}</tool_call>, parsed with
# Qwen's response template), short enough for a seq_len of a few hundred byte tokens.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
