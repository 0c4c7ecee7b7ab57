"""Prompt data (data.format=prompt, objective=grpo): read, rendered, tokenized and checked once by the
launcher before any worker starts, into RUN/data/prompts.jsonl, which the workers' rollout reads.

A record's data.prompt_field is text (tokenized as it is) or a list of chat messages (rendered with the
run's chat template and the generation prompt, as TRL does). Every other column is kept whole and reaches
the reward functions as a keyword argument. JSONL, Parquet, HF datasets on disk and hub datasets
(data.kind=hf data.path=ORG/NAME: the snapshot the launcher pinned, read with data.subset and data.split)
are read.

Checked here, exit 2: a prompt longer than training.seq_len - objective.max_completion_length (how many,
the longest, the fix); fewer prompts than one generation batch needs; each reward function called once
on the first record (dtlaunch.inputs.tools.check_rewards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from dtlaunch.data.chat_templates import chosen_chat_template
from dtlaunch.data.records import load_hf, source_files
from dtlaunch.errors import InputError
from dtlaunch.inputs.tools import check_rewards

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

PROMPTS_FILE = "data/prompts.jsonl"
META_FILE = "data/prompts_meta.json"
# Tokens that end an assistant turn in the common chat templates: generation stops at them as at EOS.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>", "<eos>")


def iter_prompt_records(
    kind: str, path: str, split: str, key: str = "data.path", subset: Optional[str] = None
) -> Iterator[tuple[dict, str]]:
    """(the whole record, where) of a jsonl / parquet / hf source, in file order (`subset`: a hub dataset's
    configuration, as dtlaunch.data.records.iter_records takes it)."""
    if kind == "jsonl":
        for f in source_files(kind, path, key):
            for n, line in enumerate(f.read_bytes().splitlines(), 1):
                if line.strip():
                    yield _json_record(line, f, n, key), f"{f}:{n}"
    elif kind == "parquet":
        import pyarrow.parquet as pq

        for f in source_files(kind, path, key):
            for n, record in enumerate(pq.read_table(f).to_pylist(), 1):
                yield record, f"{f}:row {n}"
    elif kind == "hf":
        for n, record in enumerate(load_hf(path, split, key, subset), 1):
            yield dict(record), f"{path}[{split}]:{n}"
    else:
        raise InputError(f"data.format=prompt reads jsonl, parquet or hf records, not data.kind={kind}")


def first_prompt_record(kind: str, path: str, split: str, field: str) -> Optional[tuple[dict, str]]:
    """(the first record, where) of a local jsonl / parquet / hf source, or None when it holds none: the
    record the reward functions are tried on. Reads that record alone (the first line, the first row),
    so that checking a job of a large corpus stays quick."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        for f in source_files(kind, path, "data.path"):
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1):
                if batch.num_rows:
                    return _with_prompt(batch.to_pylist()[0], f"{f}:row 1", field)
        return None
    if kind == "jsonl":
        for f in source_files(kind, path, "data.path"):
            with f.open("rb") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        return _with_prompt(_json_record(line, f, n), f"{f}:{n}", field)
        return None
    for record, where in iter_prompt_records(kind, path, split):
        return _with_prompt(record, where, field)
    return None


def _with_prompt(record: dict, where: str, field: str) -> tuple[dict, str]:
    if field not in record:
        raise InputError(f"data.path: {where} has no field '{field}' (data.prompt_field): fix the record")
    return record, where


def _json_record(line: bytes, f: Path, n: int, key: str = "data.path") -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        raise InputError(f"{key}: {f}:{n} is not JSON: each line of a .jsonl file must be one object") from None
    if not isinstance(record, dict):
        raise InputError(f"{key}: {f}:{n} is not a JSON object")
    return record


class PromptEncoder:
    """Prompts as token ids: text as is, chat messages through the chat template with the generation prompt."""

    def __init__(self, tokenizer_json: Path, chat_template: str = "", tools: Optional[list] = None) -> None:
        from transformers import PreTrainedTokenizerFast

        template, self.where = chosen_chat_template(chat_template, tokenizer_json)
        eos = _eos_token(tokenizer_json)
        self.hf = PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_json), chat_template=template or None, **({"eos_token": eos} if eos else {})
        )
        self.backend = self.hf.backend_tokenizer
        self.has_template = bool(template)
        self.tools = tools or None  # JSON schemas (objective.tools); None, not []: as TRL, no tool boilerplate

    def encode(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, str) and not self.tools:
            return self.backend.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            if not self.has_template:
                raise InputError(
                    f"data.prompt_field at {where} holds chat messages, but the tokenizer has no chat template: set "
                    f"data.chat_template (e.g. chatml)"
                )
            text = self.hf.apply_chat_template(prompt, tools=self.tools, tokenize=False, add_generation_prompt=True)
            return self.backend.encode(text, add_special_tokens=False).ids
        if isinstance(prompt, str):
            raise InputError(
                f"data.prompt_field at {where} is text, but objective.tools are called in chat turns: give the "
                f"prompts as lists of chat messages"
            )
        raise InputError(f"data.prompt_field at {where} is neither text nor a list of chat messages: fix the record")

    def stop_ids(self, eos_id: Any) -> list[int]:
        """EOS and the end-of-turn tokens the tokenizer has."""
        ids = {self.backend.token_to_id(t) for t in END_OF_TURN} | ({int(eos_id)} if eos_id is not None else set())
        return sorted(i for i in ids if i is not None)


def _eos_token(tokenizer_json: Path) -> str:
    """tokenizer_config.json's eos_token beside the tokenizer, if any (the text parse_response trims)."""
    config = Path(tokenizer_json).parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError):
        return ""
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else ""


def tool_chat(encoder: PromptEncoder, stop_ids: list[int]) -> Any:
    """The encoder's template as a ToolChat (dtlaunch.data.tool_chat), checked for tool calling."""
    from dtlaunch.data.tool_chat import ToolChat, check_tool_template

    if not encoder.has_template:
        raise InputError(
            f"objective.tools are called in chat turns, and the tokenizer has no chat template ({encoder.where}): "
            f"give it one made for tool calling (chat_template.jinja beside tokenizer.json)"
        )
    chat = ToolChat(encoder.hf, encoder.tools or [], stop_ids, encoder.where)
    check_tool_template(chat)
    return chat


def prepare_prompts(cfg: JobConfig, run_dir: Path, tokenizer_json: Path, eos_id: Any, groups_per_step: int) -> int:
    """Write RUN/data/prompts.jsonl (ids, prompt, columns) and its stop ids; returns the number of prompts."""
    d, o = cfg.data, cfg.objective
    field = str(d.prompt_field)
    limit = int(cfg.training.seq_len) - int(o.max_completion_length)
    tools, by_env = None, {}
    if list(o.tools) or str(o.environment) or dict(o.environments):
        from dtlaunch.inputs.tools import check_environments, check_tools, environment_keys

        standalone = check_tools(o)
        envs = check_environments(o, standalone)
        # Each prompt rendered with its environment's methods beside objective.tools (TRL: per example).
        by_env = {e.key: [t.schema for t in standalone + e.tools] for e in envs}
        tools = [t.schema for t in standalone] + [t.schema for e in envs for t in e.tools]
    encoder = PromptEncoder(tokenizer_json, str(d.chat_template), tools)
    if tools is not None:  # objective.tools or an environment (even one without methods: its prompts are chat)
        tool_chat(encoder, encoder.stop_ids(eos_id))
    out = run_dir / PROMPTS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    n = too_long = longest = 0
    first_long = ""
    from dtlaunch.hub.dataset import local_source

    path, subset = local_source(cfg, str(d.path))  # a hub dataset: the snapshot pinned in data.revision
    with out.open("w") as fh:
        for record, where in iter_prompt_records(str(d.kind), path, str(d.split), subset=subset):
            _with_prompt(record, where, field)
            if n == 0 and path != str(d.path):  # a hub dataset's first record, read now (a local one's: by load_job)
                check_rewards(o, record, field, where)
            if by_env:
                encoder.tools = by_env[environment_keys(envs, [record])[0]] or None
            ids = encoder.encode(record[field], where)
            if len(ids) > limit:
                too_long += 1
                first_long = first_long or where
                longest = max(longest, len(ids))
            columns = {k: v for k, v in record.items() if k != field}
            fh.write(json.dumps({"ids": ids, "prompt": record[field], "columns": columns}) + "\n")
            n += 1
    if too_long:
        raise InputError(
            f"{too_long} of {n} prompts are longer than training.seq_len - objective.max_completion_length = {limit} "
            f"tokens (the longest {longest}, first at {first_long}): raise training.seq_len to at least "
            f"{longest + int(o.max_completion_length)}, lower objective.max_completion_length, or shorten them"
        )
    if n < groups_per_step:
        raise InputError(
            f"data.path holds {n} prompts; one generation batch needs {groups_per_step} (training.global_batch / "
            f"objective.num_generations): add prompts or lower training.global_batch"
        )
    meta = {"prompts": n, "stop_ids": encoder.stop_ids(eos_id)}
    (run_dir / META_FILE).write_text(json.dumps(meta) + "\n")
    return n
