"""objective=kto against TRL's own KTOTrainer on the same weights and token ids (fp32).

A tiny Llama made by transformers is loaded into dtlaunch's model; a perturbed copy is the policy, the
original the reference. TRL's `KTOTrainer._compute_loss` scores one collated batch (its rows, their KL rows
and labels, with an explicit reference model); dtlaunch's KTOObjective scores the same rows stacked as its
loader hands them (own rows, then KL rows). Loss, parameter gradients and the logged metrics must agree.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_preference_trl import close, hf_grads, ours, perturb, tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

EXAMPLES, PROMPT, SEQ = 4, 5, 12


def batch(labels: list[bool]) -> dict[str, torch.Tensor]:
    """TRL's collated layout (DataCollatorForUnpairedPreference): rows right-padded, completion_mask on the
    completion tokens (EOS included); KL rows: each prompt with its predecessor's completion (rotated by one
    within the batch, as TRL's add_kl_completion_ids)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 250, (PROMPT,), generator=g) for _ in range(EXAMPLES)]
    completions = [torch.cat([torch.randint(2, 250, (n - 1,), generator=g), torch.tensor([1])]) for n in (7, 5, 4, 2)]
    kl = [completions[-1], *completions[:-1]]

    def rows(comps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.zeros(EXAMPLES, SEQ, dtype=torch.long)
        attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            n = PROMPT + len(c)
            ids[i, :n] = torch.cat([p, c])
            attention[i, :n] = 1
            completion[i, PROMPT:n] = 1
        return ids, attention, completion

    ids, attention, completion = rows(completions)
    kl_ids, kl_attention, kl_completion = rows(kl)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_attention,
        "KL_completion_mask": kl_completion,
        "label": torch.tensor(labels),
    }


def kto_trainer(path, tmp_path, model, ref_model, **args) -> object:
    ds = datasets.Dataset.from_list([{"prompt": "w1 w2", "completion": "w3", "label": i % 2 == 0} for i in range(4)])
    # fp32 throughout (KTOConfig defaults to bf16); per_device_train_batch_size > 1: TRL refuses 1 for loss=kto.
    config = trl.KTOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=2, **args
    )
    return trl.KTOTrainer(
        model=model, ref_model=ref_model, args=config, train_dataset=ds, processing_class=tokenizer(path)
    )


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dirs):
    return tiny_hf_dirs["llama_tied"]


@pytest.mark.parametrize(
    "loss, labels, weights, seed",
    [
        ("kto", [True, False, True, False], (1.0, 1.0), 3),
        ("kto", [True, True, False, True], (1.3, 0.7), 8),  # seed 8: a positive KL estimate (not clamped)
        ("kto", [True, True, True, True], (1.0, 1.0), 3),  # no undesirable example: no rejected metrics
        ("apo_zero_unpaired", [False, True, False, False], (0.8, 1.2), 3),
    ],
)
def test_kto_matches_trl(hf_dir, tmp_path, loss: str, labels: list, weights: tuple, seed: int) -> None:
    from dtlaunch.train.objectives.kto import KTOObjective, summarize

    ref_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    policy_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    perturb(policy_hf, seed=seed)
    dw, uw = weights
    tr = kto_trainer(
        hf_dir, tmp_path, policy_hf, ref_hf, loss_type=loss, beta=0.3, desirable_weight=dw, undesirable_weight=uw
    )
    b = batch(labels)
    trl_loss = tr._compute_loss(tr.model, b, False)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in tr._metrics["eval"].items()}  # "eval": the models are in eval mode

    policy, m = ours(hf_dir, policy_hf)
    reference, _ = ours(hf_dir, ref_hf)
    ids = torch.cat([b["input_ids"], b["KL_input_ids"]])
    mask = torch.cat([b["completion_mask"], b["KL_completion_mask"]])
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -100
    from dtlaunch.train.loss import completion_logps

    with torch.no_grad():
        ref = completion_logps(reference(inputs), targets).logps
    objective = KTOObjective(loss, 0.3, dw, uw)
    our_loss, stats = objective(policy(inputs), targets, ref, labels=b["label"])
    our_loss.backward()

    assert close(our_loss.item(), trl_loss.item()), (our_loss.item(), trl_loss.item())
    theirs = dict(policy_hf.named_parameters())
    for name, g in hf_grads(policy, m).items():
        torch.testing.assert_close(g, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    metrics = summarize(stats.tolist())
    expected = {k: v for k, v in trl_metrics.items() if k.split("/")[0] in ("rewards", "logps", "kl")}
    assert set(metrics) == set(expected), (metrics, expected)
    # The log-probs are sums of ~60 fp32 terms (TRL's come from its chunked head): 1e-5, as the DPO test.
    for key, value in metrics.items():
        assert abs(value - expected[key]) <= 1e-5 * max(1.0, abs(value)), (key, value, expected[key])
    if seed == 8:
        assert metrics["kl"] > 0  # the clamp did not hide the estimate


def test_trl_refuses_one_example_per_batch(hf_dir, tmp_path) -> None:
    """TRL refuses loss=kto with one example per device batch (its KL row would be its own completion):
    job/rules/objective.py refuses training.micro_batch=1 the same way."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="batch size must be > 1"):
        trl.KTOTrainer(
            model=model,
            args=trl.KTOConfig(
                output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=1
            ),
            train_dataset=datasets.Dataset.from_list([{"prompt": "w1", "completion": "w2", "label": True}] * 2),
            processing_class=tokenizer(hf_dir),
        )
