"""objective=reward against TRL's own RewardTrainer.compute_loss on the same weights and token ids (fp32).

transformers' LlamaForSequenceClassification (a tiny LlamaConfig model, its `score` head perturbed) is loaded
into dtlaunch's decoder with the scalar head (dtlaunch.train.objectives.reward); TRL computes the loss and its
logged metrics (accuracy, margin, mean_reward) on one collated batch, with and without the per-pair margin
column and the centring term, with a pad token of its own and with EOS as the pad (dtlaunch's pairs are
padded with EOS). dtlaunch's objective must give the same loss, gradients and metrics, and read each row's
reward where transformers does (the last non-pad token).
"""

from __future__ import annotations

import os

import pytest
import torch

from dtlaunch.convert.hf import from_hf_state, to_hf_state
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec
from dtlaunch.models.score_head import add_score_head
from dtlaunch.train.objectives.reward import RewardObjective, reward_positions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAIRS, PROMPT, SEQ = 3, 5, 12
EOS, UNK = 1, 0  # the tiny tokenizer's ids (tests/conftest.py)


def batch(pad: int) -> dict[str, torch.Tensor]:
    """TRL's collated layout: chosen rows, then rejected rows, right-padded with `pad`; rows end with EOS,
    but row 0, cut as dtlaunch cuts a long pair (it fills the row, its next token is a target beyond it)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 250, (2 * PAIRS, SEQ), generator=g)
    lengths = [12, 10, 9, 7, 11, 8]
    attention = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :PROMPT] = ids[i % PAIRS, :PROMPT]
        ids[i, n - 1] = EOS if i else ids[i, n - 1]
        ids[i, n:] = pad
        attention[i, :n] = 1
    return {"input_ids": ids, "attention_mask": attention, "lengths": torch.tensor(lengths)}


def ours_targets(b: dict) -> torch.Tensor:
    """dtlaunch's targets for these rows (its inputs are the same ids): the next token where it is a
    completion token, -100 on the prompt and the padding."""
    ids, lengths = b["input_ids"], b["lengths"]
    targets = torch.full_like(ids, -100)
    for i, n in enumerate(lengths.tolist()):
        targets[i, PROMPT - 1 : n - 1] = ids[i, PROMPT:n]
    targets[0, -1] = 7  # row 0 goes on past the batch
    return targets


def reward_trainer(path, tmp_path, model, pad_token: str, peft_config=None, **args) -> object:
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), eos_token="<eos>", pad_token=pad_token
    )
    ds = datasets.Dataset.from_list([{"prompt": "w1 w2", "chosen": "w3", "rejected": "w4"}] * 2)
    config = trl.RewardConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **args)
    return trl.RewardTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, peft_config=peft_config)


def ours(path, hf_model: torch.nn.Module) -> tuple[torch.nn.Module, object]:
    """dtlaunch's decoder with the scalar head and the HF model's weights."""
    m = compose(["model=tiny", f"model.init_from=hf:{path}"]).cfg.model
    model = model_spec(m).build(m, rope_len=SEQ, device="cpu")
    model.init_weights(0)  # RoPE buffers; the weights come next
    add_score_head(model)
    state = dict(hf_model.state_dict())
    score = state.pop("score.weight")
    missing, unexpected = model.load_state_dict(from_hf_state(state, m), strict=False)
    assert missing == ["score.weight"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        model.score.weight.copy_(score)
    return model, m


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dirs):
    return tiny_hf_dirs["llama_tied"]


@pytest.mark.parametrize(
    "pad_token, margin, center",
    [("<unk>", False, None), ("<eos>", True, 0.01), ("<unk>", True, None), ("<eos>", False, 0.5)],
)
def test_reward_matches_trl(hf_dir, tmp_path, pad_token: str, margin: bool, center) -> None:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=1, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():  # a visibly non-trivial head (transformers initialises it small)
        hf.score.weight.copy_(torch.randn(hf.score.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    tr = reward_trainer(hf_dir, tmp_path, hf, pad_token, center_rewards_coefficient=center)
    pad = EOS if pad_token == "<eos>" else UNK
    assert hf.config.pad_token_id == pad  # TRL sets it from the tokenizer
    b = batch(pad)
    inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    margins = torch.tensor([0.3, -0.2, 1.0]) if margin else None
    if margin:
        inputs["margin"] = margins
    trl_loss = tr.compute_loss(tr.model, dict(inputs))
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in tr._metrics["eval"].items()}  # "eval": the model is in eval mode

    model, m = ours(hf_dir, hf)
    targets = ours_targets(b)
    objective = RewardObjective(center_rewards_coefficient=center, pad_id=pad)
    # transformers' pick (the last non-pad token) from the ids; ours from the targets alone.
    hf_pick = ((b["input_ids"] != pad).int() * torch.arange(SEQ)).argmax(-1)
    assert reward_positions(targets, pad).tolist() == hf_pick.tolist()
    our_loss, stats = objective(model(b["input_ids"]), targets, margins)
    our_loss.backward()

    assert abs(our_loss.item() - trl_loss.item()) <= 1e-6, (our_loss.item(), trl_loss.item())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    score_grad = grads.pop("score.weight")
    torch.testing.assert_close(score_grad, hf.score.weight.grad, rtol=1e-5, atol=1e-6)
    theirs = dict(hf.named_parameters())
    for name, g in to_hf_state(grads, m).items():
        want = theirs[name].grad
        # fp32 sums in another order: within 1e-5 of the gradient's scale
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)
    metrics = objective.summarize(stats.tolist())
    for key in ("accuracy", "margin", "mean_reward"):
        assert abs(metrics[key] - trl_metrics[key]) <= 1e-6, (key, metrics[key], trl_metrics[key])


def test_margin_field_reaches_the_step(tiny_tokenizer, tmp_path) -> None:
    """data.margin_field: each pair's margin is cached beside its rows, and the loader hands the step the
    margins of its micro-batch's pairs (in pair order) as the rows beside the batch; a record whose margin is
    no number is one error naming its line; another objective refuses the field."""
    import json

    from dtlaunch.data.preference import PairSource
    from dtlaunch.errors import ConfigError, InputError
    from dtlaunch.job.validate import validate
    from dtlaunch.launch.run_data import tokenize_records
    from dtlaunch.train.data import TokenLoader

    def cfg_of(records: list, *extra: str):
        data = tmp_path / "p.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        overrides = [
            "objective=reward",
            "data.kind=jsonl",
            "data.format=preference",
            f"data.path={data}",
            f"data.tokenizer={tiny_tokenizer / 'tokenizer.json'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.margin_field=m",
            "model.vocab_size=512",
            "training.seq_len=12",
            *extra,
        ]
        cfg = compose(overrides).cfg
        validate(cfg)
        return cfg

    records = [{"prompt": "kaka", "chosen": "lolo", "rejected": "mimi", "m": m} for m in (0.5, -1, 2.25, 0)]
    cfg = cfg_of(records)
    source = PairSource(str(tokenize_records(cfg, str(cfg.data.path), "data.path")), 12, "data.path")
    assert source.margins.tolist() == [0.5, -1.0, 2.25, 0.0]
    loader = TokenLoader(source, 2, 12, 0, 0, 1, 512, shuffle=False)
    assert loader.next_batch().margins.tolist() == [0.5, -1.0]
    assert loader.next_batch().margins.tolist() == [2.25, 0.0]

    bad = [*records[:2], {**records[0], "m": "high"}]
    with pytest.raises(InputError, match=r"p\.jsonl:3 is 'high', not a number") as err:
        cfg = cfg_of(bad)
        tokenize_records(cfg, str(cfg.data.path), "data.path")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data.margin_field=m holds objective=reward's per-pair margins"):
        cfg_of(records, "objective=dpo")


LORA = {"targets": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8.0, "dropout": 0.0}


@pytest.mark.parametrize("pad_token, center", [("<eos>", None), ("<unk>", 0.01)])
def test_lora_reward_matches_trl_peft(hf_dir, tmp_path, pad_token: str, center) -> None:
    """peft=lora: TRL's RewardTrainer with a peft LoraConfig (task_type SEQ_CLS, modules_to_save=["score"]) and
    dtlaunch's decoder with the same adapters and the score head trained in full (dtlaunch.models.lora's
    modules_to_save): the same trained tensors, loss within 1e-6 and gradients. The adapters reach peft
    through the export's own name mapping (dtlaunch.convert.adapters.to_peft_state: lora_B of q_proj in HF's
    RoPE row order)."""
    from omegaconf import OmegaConf

    from dtlaunch.convert.adapters import Adapters, to_peft_state
    from dtlaunch.models.lora import apply_lora

    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=1, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        hf.score.weight.copy_(torch.randn(hf.score.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    model, m = ours(hf_dir, hf)  # before peft wraps `hf` (the score head's value is the same)
    config = peft.LoraConfig(
        task_type="SEQ_CLS",
        r=4,
        lora_alpha=8,
        target_modules=LORA["targets"],
        lora_dropout=0.0,
        modules_to_save=["score"],
    )
    tr = reward_trainer(hf_dir, tmp_path, hf, pad_token, center_rewards_coefficient=center, peft_config=config)
    apply_lora(model, model_spec(m), OmegaConf.create(LORA), modules_to_save=("score",))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # nonzero A and B (B = 0 would leave A without a gradient)
        for name, p in trained.items():
            if name != "score.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if name.endswith("lora_b") else 0.3))
        adapters = {n: p.detach() for n, p in trained.items() if n != "score.weight"}
        peft_values = to_peft_state(Adapters(adapters, 2.0, {}, m))
        theirs = {n: p for n, p in tr.model.named_parameters() if p.requires_grad}
        ours_by_peft = {}
        for name, p in theirs.items():
            key = name.replace(".default.", ".").replace(".modules_to_save.", ".")
            if key in peft_values:
                p.copy_(peft_values[key])
            ours_by_peft[name] = key
    assert sorted(ours_by_peft.values()) == sorted([*peft_values, "base_model.model.score.weight"])
    assert len(trained) == len(theirs) == 2 * 3 * int(m.n_layers) + 1  # A and B per adapted linear + the head

    pad = EOS if pad_token == "<eos>" else UNK
    b = batch(pad)
    trl_loss = tr.compute_loss(tr.model, {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
    trl_loss.backward()
    objective = RewardObjective(center_rewards_coefficient=center, pad_id=pad)
    our_loss, _ = objective(model(b["input_ids"]), ours_targets(b))
    our_loss.backward()

    assert abs(our_loss.item() - trl_loss.item()) <= 1e-6, (our_loss.item(), trl_loss.item())
    assert not any(p.grad is not None for p in model.parameters() if not p.requires_grad)
    grads = {n: p.grad for n, p in trained.items()}
    torch.testing.assert_close(grads.pop("score.weight"), theirs[_score(theirs)].grad, rtol=1e-5, atol=1e-6)
    ours_peft = to_peft_state(Adapters(grads, 2.0, {}, m))
    for name, p in theirs.items():
        if ours_by_peft[name] in ours_peft:
            want = p.grad
            got = ours_peft[ours_by_peft[name]]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)


def _score(params: dict) -> str:
    (name,) = [n for n in params if ".score." in n]
    return name
