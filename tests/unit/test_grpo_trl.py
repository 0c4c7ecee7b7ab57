"""objective=grpo's advantages, loss and gradients against TRL's GRPOTrainer on the same numbers (fp32).

One GRPOTrainer (tiny Qwen2 from transformers' config classes) scores a fixed generation batch: its
`_generate` is handed our prompt / completion ids (no sampling), its `_get_per_token_logps_and_entropies`
our per-token log-probs (a leaf tensor, so both sides' gradients are taken with respect to the same
values). TRL's own `_generate_and_score_completions` computes rewards and advantages with our reward
functions and weights, and its `_compute_loss` the loss; dtlaunch's reward calls (inputs/rewards.py),
advantages and grpo_loss (train/objectives/grpo.py) must give the same numbers within 1e-6. Then the same
with objective.tools: multi-turn completions with tool calls (below).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dtlaunch.inputs.rewards import Reward, call_reward
from dtlaunch.train.objectives.grpo import GRPOSettings, advantages, grpo_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PROMPTS, G, MAX_LEN, EOS = 3, 4, 6, 1
ANSWERS = ["w7", None, "w9"]  # the second prompt has no answer: the answer reward returns None for it


def length_reward(prompts, completions, completion_ids, **kw):
    return [len(ids) / MAX_LEN for ids in completion_ids]


def answer_reward(prompts, completions, completion_ids, answer, **kw):
    return [None if a is None else float(a in c.split()) for c, a in zip(completions, answer, strict=True)]


def group_constant_reward(prompts, completions, completion_ids, **kw):
    # Equal within each prompt's group except the first prompt's: a zero-std group for scale_rewards=group.
    return [1.0 if p.endswith("w3") else float(ids[0] % 3) for p, ids in zip(prompts, completion_ids, strict=True)]


FUNCS, WEIGHTS = [length_reward, answer_reward, group_constant_reward], [1.0, 0.5, -2.0]


def generation_batch() -> tuple[list[str], list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(11)
    prompts = [f"w{2 + i} w{i + 20} w3"[: 9 + i] for i in range(PROMPTS)]
    prompt_ids, completion_ids = [], []
    for i in range(PROMPTS * G):
        n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
        ids = torch.randint(2, 40, (n,), generator=g).tolist()
        if i % 3 != 2 and n < MAX_LEN:
            ids[-1] = EOS  # ended; the others are cut at MAX_LEN (or shorter without an EOS: still "truncated")
        if i % 5 == 0:
            ids[0] = 9  # some completions contain the answer word
        completion_ids.append(ids)
        prompt_ids.append([2 + i // G] * (1 + i // G))
    return [prompts[i // G] for i in range(PROMPTS * G)], prompt_ids, completion_ids


def grpo_trainer(path: Path, output_dir: Path, **config: object):
    """A GRPOTrainer on the tiny HF directory `path` (TRL's own defaults but for `config`) and its tokenizer."""
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), eos_token="<eos>", pad_token="<unk>"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": "w1 w2", "answer": "w7"}] * PROMPTS * G)
    args = trl.GRPOConfig(
        output_dir=str(output_dir),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=G,
        per_device_train_batch_size=PROMPTS * G,
        max_completion_length=MAX_LEN,
        reward_weights=WEIGHTS,
        **config,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=FUNCS, args=args, train_dataset=ds, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    return trainer, tok


@pytest.fixture(scope="module")
def trl_trainer(tiny_hf_dirs, tmp_path_factory):
    trainer, tok = grpo_trainer(tiny_hf_dirs["qwen2"], tmp_path_factory.mktemp("trl_grpo"))
    trainer.ref_model = trainer.model  # beta > 0: the reference's log-probs are ours, handed in below
    return trainer, tok


def per_token_tensors(rows: int, cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logps = -torch.rand(rows, cols, generator=g) * 3
    return {
        "logps": logps,
        "old": logps + torch.randn(rows, cols, generator=g) * 0.3,  # some ratios outside the clip range
        "ref": logps + torch.randn(rows, cols, generator=g) * 0.2,
    }


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("mask_truncated, beta, old_policy", [(False, 0.0, False), (True, 0.04, True)])
def test_grpo_matches_trl(trl_trainer, scale, mask_truncated, beta, old_policy) -> None:
    """Advantages for each scale_rewards; then, on that scored batch, every loss_type at both importance-
    sampling levels."""
    trainer, tok = trl_trainer
    prompts, prompt_ids, completion_ids = generation_batch()
    trainer.scale_rewards, trainer.mask_truncated_completions, trainer.beta = scale, mask_truncated, beta
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    rows, cols = len(completion_ids), max(len(c) for c in completion_ids)
    t = per_token_tensors(rows, cols)
    leaf = {"v": torch.zeros(rows, cols)}
    trainer._generate = lambda p: (prompt_ids, completion_ids, None, texts, None, {}, None, None)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf["v"], torch.zeros(rows, cols), None)
    inputs = [{"prompt": p, "answer": ANSWERS[i // G]} for i, p in enumerate(prompts)]
    scored = trainer._generate_and_score_completions(inputs)

    # Ours: rewards through dtlaunch's reward calls, then advantages.
    columns = {"answer": [x["answer"] for x in inputs]}
    per_func = torch.tensor(
        [
            call_reward(Reward(f.__name__, f, w), prompts, texts, completion_ids, columns)
            for f, w in zip(FUNCS, WEIGHTS, strict=True)
        ]
    ).T
    assert torch.isnan(per_func).any()  # None rewards are exercised
    adv = advantages(per_func, torch.tensor(WEIGHTS), G, scale)
    torch.testing.assert_close(adv, scored["advantages"], rtol=0, atol=1e-6)

    mask = torch.zeros(rows, cols)
    for i, ids in enumerate(completion_ids):
        truncated = ids[-1] != EOS
        mask[i, : len(ids)] = 0.0 if (mask_truncated and truncated) else 1.0
    torch.testing.assert_close(mask, scored["completion_mask"].float(), rtol=0, atol=0)
    scored.pop("old_per_token_logps", None)
    if old_policy:
        scored["old_per_token_logps"] = t["old"]
    scored["ref_per_token_logps"] = t["ref"]
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo"):
        for level in ("token", "sequence"):
            trainer.loss_type, trainer.importance_sampling_level = loss_type, level
            theirs_leaf = t["logps"].clone().requires_grad_(True)
            leaf["v"] = theirs_leaf
            trl_loss = trainer._compute_loss(trainer.model, scored)
            trl_loss.backward()

            s = GRPOSettings(loss_type, level, trainer.epsilon_low, trainer.epsilon_high, beta, MAX_LEN)
            ours_leaf = t["logps"].clone().requires_grad_(True)
            old, ref = (t["old"] if old_policy else None), (t["ref"] if beta else None)
            parts = grpo_loss(s, ours_leaf, old, ref, adv, mask, step_tokens_per_rank=mask.sum())
            parts.loss.backward()
            what = f"{loss_type}/{level}"
            torch.testing.assert_close(parts.loss, trl_loss.detach(), rtol=0, atol=1e-6, msg=what)
            torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, rtol=0, atol=1e-6, msg=what)
            assert ours_leaf.grad.abs().sum() > 0


@pytest.mark.parametrize("chunks", [1, 4])
def test_log_probs_at_a_temperature_are_trls(tiny_hf_dirs, tmp_path, chunks) -> None:
    """TRL scores every log-prob of the loss (policy, old policy, reference) on logits / temperature, the
    distribution the rollout sampled from (_get_per_token_logps_and_entropies, run here for real on its
    model); dtlaunch's token_logps on the same weights, from the logits and through the chunked head."""
    from dtlaunch.infer.generate import load_source, set_positions
    from dtlaunch.train.data import IGNORE_INDEX
    from dtlaunch.train.loss import HeadLoss
    from dtlaunch.train.objectives.grpo import token_logps

    temperature, rows, length, keep = 0.7, 5, 12, 7
    trainer, _ = grpo_trainer(tiny_hf_dirs["qwen2"], tmp_path, temperature=temperature)
    ids = torch.randint(2, 40, (rows, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), keep)
    model = load_source(f"hf:{tiny_hf_dirs['qwen2']}", torch.device("cpu")).model
    set_positions(model, length)
    targets = ids[:, 1:].clone()
    targets[:, : length - 1 - keep] = IGNORE_INDEX  # the prompt's positions: not scored
    head = None
    if chunks > 1:
        head = HeadLoss(model, chunks, fused=False).token_nll
    with torch.no_grad():
        ours = token_logps(model(ids[:, :-1], head=chunks == 1), targets, head, temperature)[:, -keep:]
        plain = token_logps(model(ids[:, :-1], head=chunks == 1), targets, head)[:, -keep:]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (ours - plain).abs().max() > 1e-2  # the temperature matters at these values


# objective.tools: multi-turn completions with tool calls.
#
# One GRPOTrainer with tools and Qwen2.5's chat template (TRL's own copy, so TRL parses it with its Qwen
# response template), over a byte-level tokenizer (tests/grpo_toy.py: JSON round-trips). Its
# `_generate_single_turn` is handed the recorded turns (the first for every row, then each row's next turn
# when it asks for one), so TRL's own `_tool_call_loop` runs the tools, renders their results and masks them.
# dtlaunch does the same with its prompt encoding (dtlaunch.data.prompts), tool loop (dtlaunch.data.tool_chat)
# and tool runner (in a child process: the default), fed the same turns. The prompt and completion
# ids, the tool mask, the rewards (a function reading the tool messages), the loss mask of the training rows,
# the advantages and the loss and gradients of each loss type must agree (within 1e-6).
#
# The turns: no call; a call and an answer; two calls in one turn then another; a call to a tool that does
# not exist; a tool that raises; a malformed call (parsed as text, no call); a result that would pass
# max_completion_length (dropped); a continuation cut at max_completion_length.

TOOL_G, TOOL_MAX_LEN = 4, 360
TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str) -> str:
    """Repeat a text loudly, many times.

    Args:
        text: What to repeat.
    """
    return (text.upper() + "! ") * 60


def broken(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")
'''
TOOL_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Shout hi."}],
]


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


END = "<|im_end|>"
# Row -> its turns (text; each continuation follows the tool results of the turn before).
TURNS = [
    ["It is 5." + END],
    [call("add", a=2, b=3) + END, "The sum is 5." + END],
    [call("add", a=2, b=3) + "\n" + call("add", a=1, b=1) + END, call("add", a=5, b=2) + END, "7" + END],
    [call("multiply", a=2, b=3) + END, "No such tool." + END],
    [call("broken", x=1) + END, "It failed." + END],
    ['<tool_call>\n{"name": "add", "arguments": \n</tool_call>' + END],
    [call("shout", text="hi") + END, "never reached" + END],
    [call("add", a=1, b=2) + END, "x" * 400 + END],
]


def tool_reward(prompts, completions, completion_ids, **kw):
    # Reads the messages: tool results seen, errors among them, and the final turn's content.
    out = []
    for c in completions:
        tools = [m for m in c if m["role"] == "tool"]
        errors = sum("error" in m["content"] for m in tools)
        out.append(len(tools) - 2 * errors + float("5" in c[-1].get("content", "")))
    return out


def length_reward(prompts, completions, completion_ids, **kw):
    return [len(ids) / TOOL_MAX_LEN for ids in completion_ids]


TOOL_FUNCS, TOOL_WEIGHTS = [tool_reward, length_reward], [1.0, 0.5]


@pytest.fixture(scope="module")
def tool_setup(tmp_path_factory):
    from grpo_toy import write_byte_tokenizer

    base = tmp_path_factory.mktemp("grpo_tools")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tokenizer_json = write_byte_tokenizer(base / "tok", template)
    (base / "my_tools.py").write_text(TOOLS_FILE)
    specs = [f"{base / 'my_tools.py'}:{n}" for n in ("add", "shout", "broken")]
    from dtlaunch.inputs.tools import load_tools

    tools = load_tools(specs)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    # The policy is never run (its log-probs are handed in): the smallest Qwen2 will do. TRL also drops tool
    # results past the model's context; dtlaunch's prompts + completions fit seq_len by construction
    # (dtlaunch.data.prompts), so only max_completion_length bounds them here.
    config = transformers.Qwen2Config(
        vocab_size=260,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=10**6,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    ds = datasets.Dataset.from_list([{"prompt": TOOL_PROMPTS[0]}] * len(TURNS))
    args = trl.GRPOConfig(
        output_dir=str(base / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=TOOL_G,
        per_device_train_batch_size=len(TURNS),
        max_completion_length=TOOL_MAX_LEN,
        reward_weights=TOOL_WEIGHTS,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=TOOL_FUNCS,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        tools=[t.fn for t in tools],
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer, tok, tokenizer_json, tools


def encode_turns(tok) -> list[list[list[int]]]:
    return [[tok.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in row] for row in TURNS]


def trl_generation(trainer, turns, prompt_ids_seen):
    """TRL's _generate_single_turn replaced: the first call answers every row's first turn, each later one
    the rows whose sequences it is handed (found by their prompt and first turn)."""
    state = {"calls": 0}

    def fake(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if state["calls"] == 0:
            prompt_ids_seen.extend(list(p) for p in prompt_ids)
            out = [row[0] for row in turns]
        else:
            out = []
            for seq in prompt_ids:
                rows = [
                    i
                    for i, row in enumerate(turns)
                    if seq[: len(prompt_ids_seen[i]) + len(row[0])] == prompt_ids_seen[i] + row[0]
                ]
                assert len(rows) == 1
                out.append(turns[rows[0]][state["calls"]])
        state["calls"] += 1
        return out, None

    trainer._generate_single_turn = fake


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_tool_calling_matches_trl(tool_setup, max_iterations) -> None:
    from dtlaunch.data.prompts import PromptEncoder, tool_chat
    from dtlaunch.data.tool_chat import tool_loop
    from dtlaunch.inputs.tools import ToolRunner
    from dtlaunch.train.data import IGNORE_INDEX
    from dtlaunch.train.objectives.rollout import training_rows

    trainer, tok, tokenizer_json, tools = tool_setup
    trainer.max_tool_calling_iterations = max_iterations if max_iterations is not None else 10**9
    turns = encode_turns(tok)
    rows = len(turns)
    prompts = [TOOL_PROMPTS[i // TOOL_G] for i in range(rows)]
    prompt_ids_seen: list[list[int]] = []
    trl_generation(trainer, turns, prompt_ids_seen)
    cols = TOOL_MAX_LEN
    leaf = {"v": torch.zeros(rows, cols)}
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf["v"], torch.zeros(rows, cols), None)
    scored = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])

    # dtlaunch: prompts encoded with the tools' schemas, then the tool loop on the same turns.
    encoder = PromptEncoder(tokenizer_json, "", [t.schema for t in tools])
    stop_ids = encoder.stop_ids(tok.convert_tokens_to_ids("<|im_end|>"))
    prompt_ids = [encoder.encode(p, "test") for p in prompts]
    assert prompt_ids == prompt_ids_seen
    runner = ToolRunner(tools, timeout_s=20.0)
    try:
        multi = tool_loop(
            tool_chat(encoder, stop_ids),
            runner,
            prompt_ids,
            [row[0] for row in turns],
            lambda idxs, seqs, limits, turn: [turns[i][turn] for i in idxs],
            TOOL_MAX_LEN,
            max_iterations,
        )
    finally:
        runner.close()

    mask = scored["completion_mask"].bool()
    theirs_ids = [scored["completion_ids"][i][mask[i]].tolist() for i in range(rows)]
    for i in range(rows):
        if multi.completion_ids[i] != theirs_ids[i]:
            print(
                "ROW",
                i,
                repr(tok.decode(multi.completion_ids[i])),
                "\nTRL",
                repr(tok.decode(theirs_ids[i])),
                multi.completions[i],
            )
    assert multi.completion_ids == theirs_ids
    theirs_tool_mask = [scored["tool_mask"][i][mask[i]].tolist() for i in range(rows)]
    assert multi.tool_mask == theirs_tool_mask
    assert any(0 in m for m in multi.tool_mask) and multi.failures >= 2  # results masked; errors returned
    assert len(multi.completion_ids[6]) == len(turns[6][0])  # the long result dropped
    assert len(multi.completion_ids[7]) == TOOL_MAX_LEN or max_iterations == 1  # the continuation cut

    per_func = torch.tensor(
        [
            call_reward(Reward(f.__name__, f, w), prompts, multi.completions, multi.completion_ids, {})
            for f, w in zip(TOOL_FUNCS, TOOL_WEIGHTS, strict=True)
        ]
    ).T
    adv = advantages(per_func, torch.tensor(TOOL_WEIGHTS), TOOL_G, "group")
    torch.testing.assert_close(adv, scored["advantages"], rtol=0, atol=1e-6)

    # The training rows' loss mask is TRL's completion_mask * tool_mask.
    truncated = [not c or c[-1] not in stop_ids for c in multi.completion_ids]
    _, targets = training_rows(prompt_ids, multi.completion_ids, truncated, multi.tool_mask, 2048, False)
    ours_mask = torch.zeros(rows, cols)
    for i, p in enumerate(prompt_ids):
        n = len(multi.completion_ids[i])
        ours_mask[i, :n] = (targets[i, len(p) - 1 : len(p) - 1 + n] != IGNORE_INDEX).float()
    theirs_mask = (scored["completion_mask"] * scored["tool_mask"]).float()
    torch.testing.assert_close(ours_mask, theirs_mask[:, :cols], rtol=0, atol=0)

    g = torch.Generator().manual_seed(5)
    logps = -torch.rand(rows, cols, generator=g) * 3
    scored.pop("old_per_token_logps", None)
    scored["old_per_token_logps"] = logps + torch.randn(rows, cols, generator=g) * 0.3
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        trainer.loss_type, trainer.importance_sampling_level = loss_type, "token"
        theirs_leaf = logps.clone().requires_grad_(True)
        leaf["v"] = theirs_leaf
        trl_loss = trainer._compute_loss(trainer.model, scored)
        trl_loss.backward()
        s = GRPOSettings(loss_type, "token", trainer.epsilon_low, trainer.epsilon_high, 0.0, TOOL_MAX_LEN)
        ours_leaf = logps.clone().requires_grad_(True)
        parts = grpo_loss(
            s, ours_leaf, scored["old_per_token_logps"], None, adv, ours_mask, step_tokens_per_rank=ours_mask.sum()
        )
        parts.loss.backward()
        torch.testing.assert_close(parts.loss, trl_loss.detach(), rtol=0, atol=1e-6, msg=loss_type)
        torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, rtol=0, atol=1e-6, msg=loss_type)


# objective.environment (TRL's environment_factory): one instance per rollout, reset with its record (the
# text it returns appended to the prompt), its methods the tools, and get_reward() scoring the rollout beside
# a reward function (weight 1, named after the class). The same replayed turns through TRL's GRPOTrainer and
# dtlaunch's runner (the instances in its child process), reset, prompt encoding and tool loop: the prompt
# ids, completion ids, tool mask, the environment's rewards and the advantages must agree (within 1e-6).

ENV_FILE = '''
class Counter:
    def __init__(self):
        self.total, self.target = 0, 0

    def reset(self, **record):
        self.total, self.target = 0, int(record["target"])
        return None if self.target == 0 else f" Reach {self.target}."

    def add(self, n: int) -> int:
        """Add to the running total.

        Args:
            n: How much to add.
        """
        self.total += n
        return self.total

    def _hidden(self) -> None:
        pass

    def get_reward(self) -> float:
        return -abs(self.target - self.total) + 0.25 * (self.total > 0)
'''
ENV_PROMPTS = [[{"role": "user", "content": "Count."}], [{"role": "user", "content": "Say hi."}]]
ENV_TARGETS = [5, 0]
ENV_TURNS = [
    [call("add", n=5) + END, "Done." + END],
    ["No." + END],
    [call("add", n=2) + "\n" + call("add", n=2) + END, call("add", n=1) + END, "ok" + END],
    [call("multiply", n=2) + END, "Hm." + END],
    ["Hi." + END],
    [call("add", n=3) + END, "x" + END],
    ['<tool_call>\n{"name": "add", "arguments": \n</tool_call>' + END],
    [call("add", n=-1) + END, "y" + END],
]


@pytest.fixture(scope="module")
def env_setup(tmp_path_factory):
    from grpo_toy import write_byte_tokenizer

    from dtlaunch.inputs.rewards import import_function

    base = tmp_path_factory.mktemp("grpo_env")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tokenizer_json = write_byte_tokenizer(base / "tok", template)
    (base / "my_env.py").write_text(ENV_FILE)
    spec = f"{base / 'my_env.py'}:Counter"
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    config = transformers.Qwen2Config(
        vocab_size=260,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=10**6,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    ds = datasets.Dataset.from_list([{"prompt": ENV_PROMPTS[0], "target": 5}] * len(ENV_TURNS))
    args = trl.GRPOConfig(
        output_dir=str(base / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=TOOL_G,
        per_device_train_batch_size=len(ENV_TURNS),
        max_completion_length=TOOL_MAX_LEN,
        reward_weights=[0.5],
    )
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        environment_factory=import_function(spec, "test"),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer, tok, tokenizer_json, spec


@pytest.mark.parametrize("timeout_s", [20.0, 0.0])
def test_environment_matches_trl(env_setup, timeout_s) -> None:
    from dtlaunch.data.prompts import PromptEncoder, tool_chat
    from dtlaunch.data.tool_chat import tool_loop
    from dtlaunch.inputs.tools import (
        ToolRunner,
        environment_keys,
        environment_reward_columns,
        environment_rewards,
        load_environment,
        reset_prompts,
        rollout_instances,
    )
    from dtlaunch.train.data import IGNORE_INDEX
    from dtlaunch.train.objectives.rollout import training_rows

    trainer, tok, tokenizer_json, spec = env_setup
    trainer.max_tool_calling_iterations = 10**9
    turns = [[tok.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in row] for row in ENV_TURNS]
    rows = len(turns)
    prompts = [ENV_PROMPTS[i // TOOL_G] for i in range(rows)]
    columns = [{"target": ENV_TARGETS[i // TOOL_G]} for i in range(rows)]
    prompt_ids_seen: list[list[int]] = []
    trl_generation(trainer, turns, prompt_ids_seen)
    cols = TOOL_MAX_LEN
    leaf = {"v": torch.zeros(rows, cols)}
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf["v"], torch.zeros(rows, cols), None)
    scored = trainer._generate_and_score_completions(
        [{"prompt": p, **c} for p, c in zip(prompts, columns, strict=True)]
    )

    env = load_environment(spec)
    assert env.tool_names() == ["add"] and env.has_reward
    runner = ToolRunner([], timeout_s, [env])
    try:
        keys = environment_keys([env], columns)
        instances = rollout_instances(keys)
        assert instances == [f"/{i}" for i in range(rows)]  # one instance per rollout
        messages = reset_prompts(runner, keys, instances, prompts, columns)
        assert messages[0][-1]["content"] == "Count. Reach 5." and messages[-1] == prompts[-1]
        encoder = PromptEncoder(tokenizer_json, "", [t.schema for t in env.tools])
        stop_ids = encoder.stop_ids(tok.convert_tokens_to_ids("<|im_end|>"))
        prompt_ids = [encoder.encode(m, "test") for m in messages]
        assert prompt_ids == prompt_ids_seen
        multi = tool_loop(
            tool_chat(encoder, stop_ids),
            runner,
            prompt_ids,
            [row[0] for row in turns],
            lambda idxs, seqs, limits, turn: [turns[i][turn] for i in idxs],
            TOOL_MAX_LEN,
            None,
            instances=instances,
        )
        (owner,) = environment_reward_columns([env])
        env_rewards = environment_rewards(runner, owner, [env], keys, instances)
    finally:
        runner.close()

    mask = scored["completion_mask"].bool()
    assert multi.completion_ids == [scored["completion_ids"][i][mask[i]].tolist() for i in range(rows)]
    assert multi.tool_mask == [scored["tool_mask"][i][mask[i]].tolist() for i in range(rows)]
    assert multi.calls == 7 and multi.failures == 1  # the unknown tool
    # The instances kept their state through the calls: row 2 added 2 + 2 + 1, row 7 -1.
    assert env_rewards == [0.25, -5.0, 0.25, -5.0, 0.0, -2.75, 0.0, -1.0]
    torch.testing.assert_close(
        torch.tensor(trainer._metrics["train"]["rewards/Counter/mean"][-1]),
        torch.tensor(sum(env_rewards) / rows),
        rtol=0,
        atol=1e-6,
    )
    length = [len(ids) / TOOL_MAX_LEN for ids in multi.completion_ids]
    per_func = torch.tensor([length, env_rewards], dtype=torch.float32).T
    adv = advantages(per_func, torch.tensor([0.5, 1.0]), TOOL_G, "group")
    torch.testing.assert_close(adv, scored["advantages"], rtol=0, atol=1e-6)

    # The loss and its gradients on the training rows (the tool results masked out).
    cols = scored["completion_mask"].shape[1]  # TRL pads to the longest completion
    truncated = [not c or c[-1] not in stop_ids for c in multi.completion_ids]
    _, targets = training_rows(prompt_ids, multi.completion_ids, truncated, multi.tool_mask, 2048, False)
    ours_mask = torch.zeros(rows, cols)
    for i, p in enumerate(prompt_ids):
        n = len(multi.completion_ids[i])
        ours_mask[i, :n] = (targets[i, len(p) - 1 : len(p) - 1 + n] != IGNORE_INDEX).float()
    torch.testing.assert_close(ours_mask, (scored["completion_mask"] * scored["tool_mask"]).float())
    g = torch.Generator().manual_seed(7)
    logps = -torch.rand(rows, cols, generator=g) * 3
    scored["old_per_token_logps"] = logps + torch.randn(rows, cols, generator=g) * 0.3
    trainer.loss_type, trainer.importance_sampling_level = "dapo", "token"
    leaf["v"] = theirs = logps.clone().requires_grad_(True)
    trl_loss = trainer._compute_loss(trainer.model, scored)
    trl_loss.backward()
    s = GRPOSettings("dapo", "token", trainer.epsilon_low, trainer.epsilon_high, 0.0, TOOL_MAX_LEN)
    ours = logps.clone().requires_grad_(True)
    parts = grpo_loss(
        s, ours, scored["old_per_token_logps"], None, adv, ours_mask, step_tokens_per_rank=ours_mask.sum()
    )
    parts.loss.backward()
    torch.testing.assert_close(parts.loss, trl_loss.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-6)


def test_the_step_scores_at_the_sampling_temperature() -> None:
    """GRPOObjective (the step's loss) takes objective.temperature from the config and scores logits / T."""
    from dtlaunch.job.compose import compose
    from dtlaunch.train.batch import RolloutRows
    from dtlaunch.train.objectives.grpo import GRPOObjective

    cfg = compose(["model=tiny", "objective=grpo", "objective.temperature=0.6", "objective.beta=0.0"]).cfg
    objective = GRPOObjective.of(cfg, accum=1)
    assert objective.settings.temperature == 0.6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=g)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[:, :2] = -100
    rows = RolloutRows(adv=torch.tensor([0.5, -1.0, 2.0]), step_tokens=torch.tensor(9.0))
    ours = logits.clone().requires_grad_(True)
    loss, _ = objective(ours, targets, rows)
    loss.backward()
    # With one iteration the ratio is 1 and the loss's value is the advantages', whatever the log-probs: the
    # temperature shows in the gradient.
    leaf = logits.clone().requires_grad_(True)
    logps = torch.log_softmax(leaf / 0.6, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    logps = logps * (targets != -100)
    mask = (targets != -100).float()
    want = grpo_loss(objective.settings, logps, None, None, rows.adv, mask, 1, rows.step_tokens).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.grad, leaf.grad, rtol=0, atol=1e-6)
    assert ours.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_correction_matches_trl(trl_trainer, mode) -> None:
    """objective.importance_sampling_correction: the sampler's log-probs against the old policy's, TRL's
    vllm_importance_sampling_correction (its _generate handed our sampler log-probs, a NaN among them: a token
    without one), each mode with both bounds; then its loss and gradients with the ratio in them."""
    from dtlaunch.train.objectives.grpo import importance_sampling_ratio

    trainer, tok = trl_trainer
    prompts, prompt_ids, completion_ids = generation_batch()
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    rows, cols = len(completion_ids), max(len(c) for c in completion_ids)
    t = per_token_tensors(rows, cols)
    g = torch.Generator().manual_seed(8)
    # Sampler log-probs a little off the old policy's, some far enough for the bounds to act.
    sampled = t["old"] + torch.randn(rows, cols, generator=g) * 0.4
    sampled_lists = [sampled[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]
    sampled_lists[2][0] = None  # vLLM's NaN log-prob: TRL's None; ours NaN
    sampled[2, 0] = float("nan")
    clip_min, clip_max = 0.5, 1.6
    trainer.scale_rewards, trainer.mask_truncated_completions, trainer.beta = "group", False, 0.04
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max
    leaf = {"v": t["old"]}  # TRL computes the old policy's log-probs for the correction
    trainer._generate = lambda p: (prompt_ids, completion_ids, None, texts, sampled_lists, {}, None, None)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf["v"], torch.zeros(rows, cols), None)
    try:
        inputs = [{"prompt": p, "answer": ANSWERS[i // G]} for i, p in enumerate(prompts)]
        scored = trainer._generate_and_score_completions(inputs)
        mask = scored["completion_mask"].float()
        ratio = importance_sampling_ratio(t["old"], sampled, mask, mode, clip_min, clip_max)
        torch.testing.assert_close(ratio, scored["importance_sampling_ratio"], rtol=0, atol=1e-6)
        assert (ratio == 0).any() if mode.endswith("mask") else (ratio == clip_max).any() or (ratio == clip_min).any()
        scored["ref_per_token_logps"] = t["ref"]
        trainer.loss_type, trainer.importance_sampling_level = "dapo", "token"
        theirs_leaf = t["logps"].clone().requires_grad_(True)
        leaf["v"] = theirs_leaf
        trl_loss = trainer._compute_loss(trainer.model, scored)
        trl_loss.backward()
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    s = GRPOSettings("dapo", "token", trainer.epsilon_low, trainer.epsilon_high, 0.04, MAX_LEN)
    ours_leaf = t["logps"].clone().requires_grad_(True)
    parts = grpo_loss(s, ours_leaf, t["old"], t["ref"], scored["advantages"], mask, 1, mask.sum(), ratio)
    parts.loss.backward()
    torch.testing.assert_close(parts.loss, trl_loss.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, rtol=0, atol=1e-6)
