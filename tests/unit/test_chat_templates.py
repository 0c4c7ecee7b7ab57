"""Built-in chat templates (data.chat_template) render what the models' own published templates render,
through transformers' apply_chat_template, and the chat encoder trains on them with loss on assistant tokens only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtlaunch.data.chat_templates import BUILTIN, chat_template_problem, load_chat_template
from dtlaunch.errors import ConfigError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# The chat templates as the models publish them in their tokenizer_config.json (the tool-calling branch of
# Qwen2.5's left out: these conversations have no tools).
CHATML_REF = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_REF = (  # Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_REF = (  # Mistral-7B-Instruct-v0.2
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}"
)
QWEN_REF = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501
REFERENCE = {"chatml": CHATML_REF, "llama3": LLAMA3_REF, "mistral": MISTRAL_REF, "qwen": QWEN_REF}
SPECIALS = {"bos_token": None, "eos_token": None}
BOS_EOS = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "mistral": ("<s>", "</s>")}

WORDS = ["hi", "hello", "bye", "be", "brief", "ok", "sure", "thanks", "result", "42", "user", "assistant", "system"]
WORDS += ["ipython", "tool", "<tool_response>", "</tool_response>", "You", "are", "Qwen,"]
WORDS += ["created", "by", "Alibaba", "Cloud.", "a", "helpful", "assistant."]
CONTROL = sorted({t for tokens in BUILTIN.values() for t in tokens})

SYSTEM = {"role": "system", "content": "be brief"}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "hello\n"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok sure"},
    ],
]


def make_tokenizer(out: Path, specials: list[str], template: str = "") -> Path:
    """A WordLevel tokenizer.json over WORDS + `specials` (and, with a template, a tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", *specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.add_tokens(["[INST]", "[/INST]"])  # control tokens of Mistral's v3 tokenizers: "[/INST]answer" splits
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    if template:
        (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out / "tokenizer.json"


def hf_tokenizer(path: Path, template: str, name: str = "") -> object:
    bos, eos = BOS_EOS.get(name, (None, None))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path), chat_template=template, bos_token=bos, eos_token=eos
    )


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("chat_tok"), CONTROL)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_renders_what_the_models_own_template_renders(tok_file: Path, name: str) -> None:
    ours, theirs = hf_tokenizer(tok_file, load_chat_template(name), name), hf_tokenizer(tok_file, REFERENCE[name], name)
    systems = [False] if name == "mistral" else [False, True]  # Mistral's format has no system turn
    for conv in CONVERSATIONS:
        for with_system in systems:
            messages = [SYSTEM, *conv] if with_system else conv
            for k in range(1, len(messages) + 1):
                for gen in (False, True):
                    want = theirs.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=gen)
                    got = ours.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=gen)
                    assert got == want, (name, messages[:k], gen)


def test_special_token_text_is_exact(tok_file: Path) -> None:
    conv = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

    def render(name: str, messages: list, gen: bool = False) -> str:
        return hf_tokenizer(tok_file, load_chat_template(name)).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )

    assert render("llama3", conv) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "hello<|eot_id|>"
    )
    assert render("qwen", conv[1:], gen=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("chatml", conv) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    # Mistral: the system text goes before the first user message.
    assert render("mistral", [*conv, {"role": "user", "content": "bye"}]) == (
        "<s>[INST] be brief\n\nhi [/INST]hello</s>[INST] bye [/INST]"
    )
    tool = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    assert render("llama3", tool).endswith("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>")
    want = hf_tokenizer(tok_file, QWEN_REF).apply_chat_template(tool, tokenize=False)
    assert render("qwen", tool) == want and "<tool_response>\n42\n</tool_response>" in want


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_template_for_a_tokenizer_without_one_masks_only_assistant_tokens(tok_file: Path, name: str) -> None:
    from dtlaunch.data.chat import ChatEncoder

    assert not (tok_file.parent / "tokenizer_config.json").exists()
    enc = ChatEncoder(tok_file, np.dtype(np.uint16), name)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    messages += [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok sure"}]
    ids, mask = enc.chat(messages, "x:1", "data.path")
    ref = hf_tokenizer(tok_file, REFERENCE[name], name)
    assert ids.tolist() == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
    # The assistant tokens: each answer's text plus the format's closing token (and Llama 3's header).
    answers = ref.convert_ids_to_tokens(ids[mask == 1].tolist())
    assert [t for t in answers if t in WORDS and t not in ("assistant",)] == ["hello", "ok", "sure"]
    prompts = ref.convert_ids_to_tokens(ids[mask == 0].tolist())
    assert "hi" in prompts and "bye" in prompts and not {"hello", "ok", "sure"} & set(prompts)


def test_given_template_overrides_the_tokenizers_and_a_jinja_file_works(tmp_path: Path) -> None:
    from dtlaunch.data.chat import ChatEncoder

    tok = make_tokenizer(tmp_path / "tok", CONTROL, template=CHATML_REF)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first = ChatEncoder(tok, np.dtype(np.uint16)).chat(messages, "x:1", "k")[0]
    llama = ChatEncoder(tok, np.dtype(np.uint16), "llama3").chat(messages, "x:1", "k")[0]
    names = hf_tokenizer(tok, "").convert_ids_to_tokens
    assert names(first.tolist())[0] == "<|im_start|>" and names(llama.tolist())[0] == "<|begin_of_text|>"
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}")
    mine, mask = ChatEncoder(tok, np.dtype(np.uint16), str(jinja)).chat(messages, "x:1", "k")
    assert names(mine.tolist()) == ["user", "hi", "assistant", "hello"] and mask.tolist() == [0, 0, 1, 1]


def test_refusals_are_one_line(tmp_path: Path) -> None:
    from dtlaunch.data.chat import ChatEncoder

    plain = make_tokenizer(tmp_path / "plain", ["</s>"])
    with pytest.raises(ConfigError, match="data.chat_template to one of chatml, qwen, llama3, mistral"):
        ChatEncoder(plain, np.dtype(np.uint16))
    ChatEncoder(plain, np.dtype(np.uint16), chat=False)  # prompt/completion records need no template
    with pytest.raises(ConfigError, match=r"data.chat_template=llama3 writes '<\|begin_of_text\|>'"):
        ChatEncoder(plain, np.dtype(np.uint16), "llama3")
    assert "data.format=chat" in chat_template_problem("chatml", "text")
    assert "neither a built-in" in chat_template_problem("chatlm", "chat")
    assert chat_template_problem("llama3", "chat") is None and chat_template_problem("", "text") is None
    for problem in (chat_template_problem("chatml", "text"), chat_template_problem("nope.jinja", "chat")):
        assert "\n" not in problem


def test_validate_reads_data_chat_template(tmp_path: Path) -> None:
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tok = make_tokenizer(tmp_path / "tok", CONTROL)
    base = ["data.kind=jsonl", f"data.path={data}", f"data.tokenizer={tok}", "model.vocab_size=64"]
    validate(compose([*base, "data.format=chat", "data.chat_template=qwen"]).cfg)
    with pytest.raises(ConfigError, match="data.chat_template=qwen is used only with data.format=chat"):
        validate(compose([*base, "data.chat_template=qwen"]).cfg)


def test_the_template_a_run_trained_with_goes_into_its_tokenizer_and_export(tmp_path: Path) -> None:
    from dtlaunch.convert.hf import export_tokenizer
    from dtlaunch.job.compose import compose
    from dtlaunch.launch.run_data import keep_tokenizer

    tok = make_tokenizer(tmp_path / "tok", CONTROL)
    run = tmp_path / "run"
    over = ["data.kind=jsonl", f"data.path={tok}", f"data.tokenizer={tok}", "data.format=chat"]
    keep_tokenizer(compose([*over, "data.chat_template=llama3"]).cfg, run)
    export_tokenizer(run / "checkpoints" / "step-00000001", tmp_path / "export")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert loaded.chat_template == load_chat_template("llama3")


def test_byte_level_bpe_masks_exactly_the_assistant_text(tmp_path: Path) -> None:
    """With a Qwen-like byte-level BPE, the target tokens decode to exactly the text the assistant turns add."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dtlaunch.data.chat import ChatEncoder

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    messages = [SYSTEM, *CONVERSATIONS[1]]
    ids, mask = ChatEncoder(tmp_path / "tokenizer.json", np.dtype(np.uint16), "qwen").chat(messages, "x:1", "k")
    ref = hf_tokenizer(tmp_path / "tokenizer.json", QWEN_REF)
    assert ids.tolist() == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
    # The generation prompt "<|im_start|>assistant\n" is context (inference writes it); the content and the
    # end of turn are targets, as TRL trains conversational prompt/completion data.
    answers = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert ref.decode(ids[mask == 1].tolist()) == answers
