"""Multi-turn completions with tool calls (objective.tools), as TRL 1.16's GRPOTrainer makes them
(trl/trainer/grpo_trainer.py: _tool_call_loop, _get_tool_suffix_ids; trl/chat_template_utils.py:
parse_response).

A completion is parsed with transformers' own response parser (tokenizer.parse_response) into an assistant
message; its `tool_calls` are run (dtlaunch.inputs.tools.ToolRunner), each result appended as a
`{"role": "tool", "name", "content"}` message, and the tool messages' tokens, as the chat template renders
them after the assistant turn (up to and including the next assistant header), are appended to the
completion; generation continues from there. Until a turn makes no call, or objective.max_tool_calling_iterations
rounds. The completion, every assistant and tool token together, stays within max_completion_length: tool
results that would pass it are dropped (the completion ends as it was), and a continuation is cut at it.
The tool mask is 0 on the tool tokens (no loss), 1 on the model's.

The parser is the tokenizer's own `response_template` when its files define one, else, for a template in
Qwen's / Hermes' format (`<tool_call>{json}</tool_call>` in ChatML turns), the response template TRL sets for
Qwen2.5 / Qwen3 (trl.chat_template_utils.qwen3_template); any other format is refused before launch. The
template must be prefix-preserving (a conversation renders the same with more turns after it), since the
tool tokens are the difference of two renderings; where TRL swaps a template that is not for a training
variant of its own, dtlaunch refuses it before launch.

Torch-free: the launcher checks the template with it (check_tool_template) before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from dtlaunch.errors import InputError

# TRL's response template for Qwen2.5 / Qwen3 (trl.chat_template_utils.qwen3_template): reasoning in
# <think>, each tool call a JSON object in <tool_call> tags, the content up to <|im_end|>.
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


class Runner(Protocol):
    def call(self, name: str, arguments: Any, instance: Optional[str] = None) -> tuple[str, bool]: ...


class ToolChat:
    """The chat template's side of tool calling: parse a turn, render tool results as tokens."""

    def __init__(self, hf: Any, tools: Sequence[dict], stop_ids: Sequence[int], where: str) -> None:
        self.hf, self.tools, self.stop_ids, self.where = hf, list(tools), set(stop_ids), where
        self.backend = hf.backend_tokenizer
        template = hf.chat_template or ""
        if getattr(hf, "response_template", None) is None:
            if "<tool_call>" not in template:
                raise InputError(
                    f"objective.tools: the chat template {where} writes tool calls in a format dtlaunch cannot parse "
                    f"(it knows Qwen's <tool_call>{{json}}</tool_call>, or the tokenizer's own response_template): "
                    f"use a Qwen-style template, or set response_template in tokenizer_config.json"
                )
            hf.response_template = QWEN_RESPONSE_TEMPLATE

    def encode(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list] = None) -> list[int]:
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def parse(self, ids: Sequence[int], prefix: Sequence[int]) -> dict:
        """TRL's parse_response: the turn as an assistant message (with `tool_calls` when it made any); a turn
        the parser cannot read (a malformed call) is its decoded text."""
        try:
            parsed = self.hf.parse_response(list(ids), prefix=list(prefix), tools=self.tools or None)
            if parsed is None:
                raise ValueError("parse_response returned None")
            if isinstance(parsed.get("content"), str) and self.hf.eos_token:
                parsed["content"] = parsed["content"].removesuffix(self.hf.eos_token)
            if not parsed.get("content"):
                parsed["content"] = ""
            if "tool_calls" in parsed:
                _validate_tool_calls(parsed["tool_calls"])
        except (ValueError, TypeError):
            parsed = {"role": "assistant", "content": self.hf.decode(list(ids), skip_special_tokens=True)}
        return parsed

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens that follow a turn ending at its end-of-turn token: the tool messages and the next
        assistant header (TRL's _get_tool_suffix_ids; TRL cuts at the tokenizer's EOS, which is the end of
        turn for the chat models it parses; dtlaunch cuts at the last stop id: EOS or an end-of-turn token)."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = self.encode(dummy, add_generation_prompt=False)
        full = self.encode(dummy + tool_messages, add_generation_prompt=True)
        ends = [i for i, t in enumerate(prefix) if t in self.stop_ids]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise InputError(
                f"objective.tools: the chat template {self.where} renders an assistant turn differently once tool "
                f"messages follow it: set data.chat_template to a prefix-preserving one (for Qwen3: TRL's "
                f"trl/chat_templates/qwen3_training.jinja)"
            )
        return full[len(prefix) :]


def _validate_tool_calls(tool_calls: Any) -> None:
    """TRL's _validate_tool_calls: a malformed call is a parse failure; missing arguments are {}."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for idx, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{idx}] must be a dict.")
        target = call.get("function", call) if "function" in call else call
        if not isinstance(target, dict):
            raise ValueError(f"tool_calls[{idx}]['function'] must be a dict.")
        if not isinstance(target.get("name"), str):
            raise ValueError(f"tool_calls[{idx}] has no name.")
        if target.get("arguments") is None:
            target["arguments"] = {}


def check_tool_template(chat: ToolChat) -> None:
    """Before launch: the template renders a whole tool exchange (the call's name, its argument, the result)
    and is prefix-preserving (TRL: supports_tool_calling, is_chat_template_prefix_preserving)."""
    name, key, value, content = "tool_name_a8f3", "tool_arg_b9d4", "tool_val_d6e7", "tool_content_c4f9"
    calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": name, "content": content},
    ]
    try:
        text = chat.hf.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - the template is user code
        raise InputError(
            f"objective.tools: the chat template {chat.where} cannot render a tool call and its result "
            f"({type(exc).__name__}: {exc}): use a template made for tool calling"
        ) from None
    dropped = [s for s in (name, key, value, content) if s not in text]
    if dropped:
        raise InputError(
            f"objective.tools: the chat template {chat.where} does not render tool calls and tool results (it "
            f"drops '{dropped[0]}'): use a template made for tool calling"
        )
    chat.suffix_ids([messages[2]])  # refuses a template that is not prefix-preserving


@dataclass
class MultiTurn:
    completion_ids: list[list[int]]  # every assistant and tool token after the prompt
    tool_mask: list[list[int]]  # 1 on the model's tokens, 0 on the tool messages'
    completions: list[list[dict]]  # the messages: assistant, tool..., assistant, ...
    calls: int
    failures: int


# generate(rows, sequences, limits, turn) -> each row's new tokens (at most its limit), turn 1, 2, ...
Generate = Callable[[list[int], list[list[int]], list[int], int], list[list[int]]]


def tool_loop(
    chat: ToolChat,
    runner: Runner,
    prompt_ids: Sequence[Sequence[int]],
    first_turns: Sequence[Sequence[int]],
    generate: Generate,
    max_completion_length: int,
    max_iterations: Optional[int],
    any_left: Callable[[bool], bool] = bool,
    instances: Optional[Sequence[str]] = None,
) -> MultiTurn:
    """TRL's _tool_call_loop on dtlaunch's generation. `any_left(this rank has rows)`: whether any rank has
    (data-parallel ranks generate together: each calls `generate` as long as one has rows). `instances`: each
    row's environment instance (objective.environment), whose methods its calls may name too."""
    completion_ids = [list(c) for c in first_turns]
    completions = [[chat.parse(ids, prompt_ids[i])] for i, ids in enumerate(completion_ids)]
    tool_mask = [[1] * len(ids) for ids in completion_ids]
    pending = [c[0].get("tool_calls") for c in completions]
    idxs = [i for i, calls in enumerate(pending) if calls]
    tool_calls = [pending[i] for i in idxs]
    limit = max_iterations if max_iterations is not None else float("inf")
    n_calls = failures = iteration = 0
    while any_left(bool(idxs)) and iteration < limit:
        before = [len(completions[i]) for i in idxs]
        for i, calls in zip(idxs, tool_calls, strict=True):
            for call in calls:
                n_calls += 1
                if call.get("type") == "function":
                    name = call["function"]["name"]
                    instance = instances[i] if instances is not None else None
                    content, failed = runner.call(name, call["function"]["arguments"], instance=instance)
                else:
                    name, failed = call.get("name", "unknown"), True
                    content = str({"error": f"Unsupported tool call type: {call.get('type')}"})
                failures += int(failed)
                message = {"role": "tool", "name": name, "content": content}
                completions[i].append(message)
        sequences = []
        for i in idxs:
            tool_messages = []
            for message in reversed(completions[i]):
                if message["role"] != "tool":
                    break
                tool_messages.insert(0, message)
            sequences.append(list(prompt_ids[i]) + completion_ids[i] + chat.suffix_ids(tool_messages))
        used = [len(s) - len(prompt_ids[i]) for i, s in zip(idxs, sequences, strict=True)]
        overlong = [u > max_completion_length for u in used]
        for i, n, too_long in zip(idxs, before, overlong, strict=True):
            if too_long:  # the results would not fit: dropped, the completion ends as it was
                del completions[i][n:]
        keep = [k for k, too_long in enumerate(overlong) if not too_long]
        idxs, sequences, used = [idxs[k] for k in keep], [sequences[k] for k in keep], [used[k] for k in keep]
        if not any_left(bool(idxs)):
            break
        limits = [max_completion_length - u for u in used]
        new = generate(idxs, sequences, limits, iteration + 1)
        new = [list(ids)[:cap] for ids, cap in zip(new, limits, strict=True)]
        parsed = []
        for i, seq, ids in zip(idxs, sequences, new, strict=True):
            tool_length = len(seq) - len(prompt_ids[i]) - len(completion_ids[i])
            tool_mask[i] += [0] * tool_length + [1] * len(ids)
            completion_ids[i] = seq[len(prompt_ids[i]) :] + ids
            message = chat.parse(ids, seq) if ids else {}
            if message:  # {}: the continuation was cut to nothing
                completions[i].append(message)
            parsed.append(message)
        pending = [m.get("tool_calls") for m in parsed]
        idxs = [i for i, calls in zip(idxs, pending, strict=True) if calls]
        tool_calls = [calls for calls in pending if calls]
        iteration += 1
    return MultiTurn(completion_ids, tool_mask, completions, n_calls, failures)
