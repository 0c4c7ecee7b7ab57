"""Preference losses against TRL's own code on the same weights and token ids (fp32).

A tiny Llama made by transformers is loaded into dtlaunch's model (convert/hf); a perturbed copy is the
policy, the original the reference. TRL's DPOTrainer computes its loss and metrics on one collated batch
(`_compute_loss`, with an explicit reference copy, or with PEFT adapters switched off); ORPO and SimPO go
through TRL's ORPOTrainer.odds_ratio_loss / CPOTrainer.cpo_loss on TRL's log-probs. dtlaunch's objective
(dtlaunch.train.objectives) must give the same loss, parameter gradients and reward metrics.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dtlaunch.convert.hf import from_hf_state, load_hf_weights, to_hf_state
from dtlaunch.job.compose import compose
from dtlaunch.models.lora import apply_lora, hf_module_name
from dtlaunch.models.registry import model_spec
from dtlaunch.train.objectives import PreferenceObjective, summarize

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAIRS, PROMPT, SEQ = 3, 5, 12  # 3 pairs; rows of 12 tokens, completions of different lengths


def batch() -> dict[str, torch.Tensor]:
    """TRL's collated layout: chosen rows, then rejected rows, right-padded; completion_mask marks completion
    tokens (EOS included), attention_mask the real ones."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 250, (2 * PAIRS, SEQ), generator=g)
    lengths = [12, 10, 9, 7, 12, 8]  # prompt (5) + completion, per row
    attention = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    completion = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :PROMPT] = ids[i % PAIRS, :PROMPT]  # a pair shares its prompt
        ids[i, n - 1] = 1  # EOS ends each completion
        ids[i, n:] = 0  # padding
        attention[i, :n] = 1
        completion[i, PROMPT:n] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def ours_targets(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """dtlaunch's (inputs, targets): next-token targets, -100 where the token is no completion token."""
    ids = b["input_ids"]
    targets = ids[:, 1:].clone()
    targets[b["completion_mask"][:, 1:] == 0] = -100
    return ids[:, :-1], targets


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def ours(path, hf_model: torch.nn.Module, peft: dict | None = None) -> tuple[torch.nn.Module, object]:
    """dtlaunch's model with the HF model's weights (and LoRA adapters when `peft` is given)."""
    m = compose(["model=tiny", f"model.init_from=hf:{path}"]).cfg.model
    model = model_spec(m).build(m, rope_len=SEQ, device="cpu")
    model.init_weights(0)  # RoPE buffers; the weights come next
    model.load_state_dict(from_hf_state(dict(hf_model.state_dict()), m), strict=False)
    if peft is not None:
        apply_lora(model, model_spec(m), OmegaConf.create(peft))
    return model, m


def hf_grads(model: torch.nn.Module, m: object) -> dict[str, torch.Tensor]:
    """dtlaunch's parameter gradients under transformers' names and layout."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return to_hf_state(grads, m)


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dirs):
    return tiny_hf_dirs["llama_tied"]


def tokenizer(path):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), eos_token="<eos>", pad_token="<unk>"
    )


def dpo_trainer(path, tmp_path, model, ref_model, **args) -> object:
    ds = datasets.Dataset.from_list([{"prompt": "w1 w2", "chosen": "w3", "rejected": "w4"}] * 2)
    # fp32 throughout: DPOConfig defaults to bf16, which wraps the reference's forward in autocast.
    config = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **args)
    return trl.DPOTrainer(
        model=model, ref_model=ref_model, args=config, train_dataset=ds, processing_class=tokenizer(path)
    )


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize(
    "loss, smoothing, sft_weight",
    [("sigmoid", 0.0, 0.0), ("ipo", 0.0, 0.0), ("hinge", 0.0, 0.0), ("robust", 0.2, 0.5)],
)
def test_dpo_matches_trl(hf_dir, tmp_path, loss: str, smoothing: float, sft_weight: float, chunks: int) -> None:
    ref_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    policy_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    perturb(policy_hf, seed=3)
    types = [loss] + (["sft"] if sft_weight else [])
    weights = [1.0] + ([sft_weight] if sft_weight else [])
    tr = dpo_trainer(
        hf_dir, tmp_path, policy_hf, ref_hf, loss_type=types, loss_weights=weights, beta=0.3, label_smoothing=smoothing
    )
    b = batch()
    trl_loss = tr._compute_loss(tr.model, b, False)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in tr._metrics["eval"].items()}  # "eval": the models are in eval mode

    policy, m = ours(hf_dir, policy_hf)
    reference, _ = ours(hf_dir, ref_hf)
    objective = PreferenceObjective("dpo", loss, 0.3, smoothing, sft_weight, 0.0)
    inputs, targets = ours_targets(b)
    with torch.no_grad():
        ref = objective_ref(reference, inputs, targets, chunks)
    policy_head = head(policy, chunks)
    our_loss, stats = objective(policy_head.model_output(policy, inputs), targets, ref, policy_head.token_nll)
    our_loss.backward()

    assert close(our_loss.item(), trl_loss.item()), (our_loss.item(), trl_loss.item())
    theirs = dict(policy_hf.named_parameters())
    for name, g in hf_grads(policy, m).items():
        torch.testing.assert_close(g, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    metrics = summarize(stats.tolist())
    for key, value in metrics.items():
        assert abs(value - trl_metrics[key]) <= 1e-5 * max(1.0, abs(value)), (key, value, trl_metrics[key])


def close(a: float, b: float) -> bool:
    """Within 1e-6, relative above 1 (fp32 holds ~7 significant digits)."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def head(model: torch.nn.Module, chunks: int):
    """The model's HeadLoss: with chunks > 1 the model returns its hidden states and the head runs chunk by
    chunk over the tokens (training.loss_chunks), the full logits never made."""
    from dtlaunch.train.loss import HeadLoss

    return HeadLoss(model, chunks)


def objective_ref(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    from dtlaunch.train.loss import completion_logps

    model_head = head(model, chunks)
    return completion_logps(model_head.model_output(model, inputs), targets, token_nll=model_head.token_nll).logps


LORA = {"targets": ["v_proj", "o_proj", "gate_proj"], "rank": 4, "alpha": 8.0, "dropout": 0.0}


def lora_pair(hf_dir) -> tuple:
    """(peft model, dtlaunch model, model config) with the same adapters: A random, B = 0 (as initialised)."""
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model, m = ours(hf_dir, base, peft=LORA)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA["targets"], lora_dropout=0.0)
    peft_model = peft.get_peft_model(base, config)
    set_adapters(peft_model, model, m, a_scale=0.3, b_scale=0.0)
    return peft_model, model, m


def set_adapters(peft_model, model, m, a_scale: float, b_scale: float, which: str = "default") -> None:
    """Seeded random A (and B, 0 for b_scale 0) into our adapters and peft's adapter `which`."""
    g = torch.Generator().manual_seed(11)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in adapters.items():
            p.copy_(torch.randn(p.shape, generator=g) * (b_scale if name.endswith("lora_b") else a_scale))
        # Same values into peft, matched through the family's HF module names (no RoPE permutation on v, o, gate).
        spec = model_spec(m)
        by_hf = {f"{hf_module_name(spec, n.rsplit('.', 1)[0])}.{n.rsplit('.', 1)[1]}": p for n, p in adapters.items()}
        for name, p in peft_model.named_parameters():
            if "lora_" in name and f".{which}." in name:
                module = name.replace("base_model.model.", "").split(".lora_")[0]
                p.copy_(by_hf[f"{module}.{'lora_a' if '.lora_A.' in name else 'lora_b'}"])


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("b_scale", [0.0, 0.2])
def test_lora_dpo_matches_trl_with_adapters_off_reference(hf_dir, tmp_path, b_scale: float, chunks: int) -> None:
    from dtlaunch.train.batch import MicroBatch
    from dtlaunch.train.objectives.reference import AdaptersOff

    peft_model, model, m = lora_pair(hf_dir)
    # TRL copies a PEFT model's adapter as the "ref" adapter (B = 0 here: the base model, adapters off); the
    # trained adapter then moves away from it.
    tr = dpo_trainer(hf_dir, tmp_path, peft_model, None, loss_type=["sigmoid"], beta=0.1)
    set_adapters(peft_model, model, m, a_scale=0.3, b_scale=b_scale)
    b = batch()
    trl_loss = tr._compute_loss(tr.model, b, False)
    trl_loss.backward()
    inputs, targets = ours_targets(b)
    head_loss = head(model, chunks)
    ref = AdaptersOff(model, None, head_loss)(inputs, targets, MicroBatch(inputs, targets))
    objective = PreferenceObjective("dpo", "sigmoid", 0.1, 0.0, 0.0, 0.0)
    our_loss, _ = objective(head_loss.model_output(model, inputs), targets, ref, head_loss.token_nll)
    our_loss.backward()
    if b_scale == 0:
        # At initialisation the policy is the reference: Δ = 0 and the loss is exactly ln 2.
        assert our_loss.item() == pytest.approx(math.log(2), abs=1e-7)
        assert trl_loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert close(our_loss.item(), trl_loss.item()), (our_loss.item(), trl_loss.item())
    theirs = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None and ".ref." not in n}
    ours_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(theirs) == len(ours_grads) > 0
    for a, b_ in zip(sorted(ours_grads.values(), key=_norm), sorted(theirs.values(), key=_norm), strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def trl_logps(hf_model: torch.nn.Module, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's get_batch_logps (per-token averages, as ORPO and SimPO use) and ORPO's chosen NLL."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    labels = b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)
    logits = hf_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    avg = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    chosen_logits, chosen_labels = logits[:PAIRS, :-1], labels[:PAIRS, 1:]
    nll = torch.nn.functional.cross_entropy(chosen_logits.flatten(0, 1), chosen_labels.flatten(0, 1))
    return avg, nll


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_reference_free_objectives_match_trl(hf_dir, name: str, chunks: int) -> None:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    policy_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    perturb(policy_hf, seed=5)
    b = batch()
    avg, nll = trl_logps(policy_hf, b)
    this = SimpleNamespace(
        beta=0.4,
        simpo_gamma=0.3,
        label_smoothing=0.0,
        loss_type="simpo",
        alpha=0.0,  # AlphaPO off: plain log-prob rewards
        accelerator=SimpleNamespace(device="cpu"),
    )
    if name == "orpo":
        losses, rc, rr, _, _ = ORPOTrainer.odds_ratio_loss(this, avg[:PAIRS], avg[PAIRS:])
        trl_loss = nll - losses.mean()  # ORPOTrainer.get_batch_loss_metrics
    else:
        losses, rc, rr = CPOTrainer.cpo_loss(this, avg[:PAIRS], avg[PAIRS:])
        trl_loss = losses.mean()
    trl_loss.backward()

    policy, m = ours(hf_dir, policy_hf)
    inputs, targets = ours_targets(b)
    objective = PreferenceObjective(name, "sigmoid", 0.4, 0.0, 0.0, 0.3)
    policy_head = head(policy, chunks)
    our_loss, stats = objective(policy_head.model_output(policy, inputs), targets, None, policy_head.token_nll)
    our_loss.backward()
    assert close(our_loss.item(), trl_loss.item()), (our_loss.item(), trl_loss.item())
    theirs = dict(policy_hf.named_parameters())
    for pname, g in hf_grads(policy, m).items():
        torch.testing.assert_close(g, theirs[pname].grad, rtol=1e-5, atol=1e-6, msg=pname)
    metrics = summarize(stats.tolist())
    assert metrics["rewards/chosen"] == pytest.approx(rc.mean().item(), abs=1e-6)
    assert metrics["rewards/rejected"] == pytest.approx(rr.mean().item(), abs=1e-6)
    assert metrics["rewards/accuracies"] == pytest.approx((rc > rr).float().mean().item())


def test_loaded_weights_are_the_hf_models(hf_dir) -> None:
    """The helper above really loads the HF weights (else every comparison would compare nothing)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model, m = ours(hf_dir, hf)
    state = load_hf_weights(hf_dir, m)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
