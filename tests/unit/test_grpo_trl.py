"""objective=grpo's advantages, loss and gradients against TRL's GRPOTrainer on the same numbers (fp32).

One GRPOTrainer (tiny Qwen2 from transformers' config classes) scores a fixed generation batch: its
`_generate` is handed our prompt / completion ids (no sampling), its `_get_per_token_logps_and_entropies`
our per-token log-probs (a leaf tensor, so both sides' gradients are taken with respect to the same
values). TRL's own `_generate_and_score_completions` computes rewards and advantages with our reward
functions and weights, and its `_compute_loss` the loss; dtlaunch's reward calls (inputs/rewards.py),
advantages and grpo_loss (train/objectives/grpo.py) must give the same numbers within 1e-6.
"""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def trl_trainer(tiny_hf_dirs, tmp_path_factory):
    path = tiny_hf_dirs["qwen2"]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), eos_token="<eos>", pad_token="<unk>"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": "w1 w2", "answer": "w7"}] * PROMPTS * G)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl_grpo")),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=G,
        per_device_train_batch_size=PROMPTS * G,
        max_completion_length=MAX_LEN,
        reward_weights=WEIGHTS,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=FUNCS, args=args, train_dataset=ds, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.ref_model = model  # beta > 0: the reference's log-probs are ours, handed in below
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
