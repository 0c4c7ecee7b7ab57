"""The LoRA linear's parameters, target selection by Hugging Face names, the peft section's rules, the
base fingerprint and the peft name mapping (RoPE permutation of q/k's lora_B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.lora import adapt_linear, adapter_init, apply_lora, effective_matrix, select_targets
from dtlaunch.models.registry import model_spec


def test_adapted_linear_keeps_its_base_parameters() -> None:
    # The numerics are checked against peft on a whole trained model (tests/e2e/test_lora_cli.py).
    lin = nn.Linear(12, 10, bias=True)
    weight = lin.weight
    adapt_linear(lin, rank=4, alpha=8.0)
    assert isinstance(lin, nn.Linear) and lin.weight is weight and lin.scaling == 2.0
    assert [(n, tuple(p.shape)) for n, p in lin.named_parameters()] == [
        ("weight", (10, 12)),
        ("bias", (10,)),
        ("lora_a", (4, 12)),
        ("lora_b", (10, 4)),
    ]


def test_effective_matrix_is_the_weights_without_the_adapters_dropout() -> None:
    """effective_matrix (DeepSeek-V3's absorbed wkv_b) reads a linear's matrix through the module: the plain
    weight's transpose, and with LoRA the base + scaling * B @ A, peft's dropout skipped in training mode (it
    would drop entries of the identity) and the module's mode left as it was."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(12, 10, bias=False)
    like = torch.zeros(())
    assert torch.equal(effective_matrix(lin, like), lin.weight.detach().t())
    adapt_linear(lin, rank=4, alpha=8.0, dropout=0.5)
    with torch.no_grad():
        lin.lora_a.copy_(torch.randn(lin.lora_a.shape, generator=g))
        lin.lora_b.copy_(torch.randn(lin.lora_b.shape, generator=g))
    expected = (lin.weight + lin.scaling * lin.lora_b @ lin.lora_a).detach().t()
    eye = torch.eye(12)
    with torch.no_grad():
        lin.eval()
        evaluated = lin(eye)
        lin.train()
        torch.manual_seed(1)
        dropped = lin(eye)  # what running the module on the identity gives in training mode
        got = effective_matrix(lin, like)
    assert lin.training
    assert not torch.allclose(dropped, expected, atol=1e-3)
    assert torch.equal(got, evaluated)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_adapter_init_is_seeded_by_name() -> None:
    a = adapter_init("layers.0.attention.wq.lora_a", (8, 64), seed=3)
    assert torch.equal(a, adapter_init("layers.0.attention.wq.lora_a", (8, 64), seed=3))
    assert not torch.equal(a, adapter_init("layers.1.attention.wq.lora_a", (8, 64), seed=3))
    assert a.abs().max() <= 64**-0.5 and a.std() > 0.5 * 64**-0.5 / 3**0.5  # Kaiming-uniform bound 1/sqrt(in)
    assert not adapter_init("layers.0.attention.wq.lora_b", (64, 8), seed=3).any()
    assert adapter_init("layers.0.attention.wq.weight", (64, 64), seed=3) is None


def _meta(overrides: list[str]) -> tuple:
    cfg = compose(overrides).cfg
    spec = model_spec(cfg.model)
    return cfg, spec, spec.build(cfg.model, rope_len=4, device="meta")


def test_targets_by_hf_name_and_freezing() -> None:
    cfg, spec, model = _meta(["peft=lora", "peft.targets=[q_proj,down_proj]"])
    chosen = apply_lora(model, spec, cfg.peft)
    assert chosen == [f"layers.{i}.{m}" for i in range(4) for m in ("attention.wq", "feed_forward.w2")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{f}.{leaf}" for f in chosen for leaf in ("lora_a", "lora_b")}


def test_modules_to_save_train_in_full_also_after_refreezing() -> None:
    """A reward model's score head (modules_to_save) trains beside the adapters; freeze_base, which tensor
    parallel calls again after its styles re-create parameters as trainable ones, keeps it so."""
    from dtlaunch.models.lora import freeze_base
    from dtlaunch.models.score_head import add_score_head

    cfg, spec, model = _meta(["peft=lora", "peft.targets=[q_proj]"])
    chosen = apply_lora(model, spec, cfg.peft, modules_to_save=add_score_head(model))
    adapters = {f"{f}.{leaf}" for f in chosen for leaf in ("lora_a", "lora_b")}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters | {"score.weight"}
    model.norm.weight = nn.Parameter(model.norm.weight.detach())  # re-created trainable, as SequenceParallel does
    model.score.weight = nn.Parameter(model.score.weight.detach(), requires_grad=False)
    freeze_base(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters | {"score.weight"}


def test_unknown_target_lists_the_valid_ones() -> None:
    _, spec, model = _meta([])
    with pytest.raises(ConfigError, match=r"'qproj' is not a linear module.*down_proj, gate_proj, k_proj, o_proj"):
        select_targets(model, spec, ["q_proj", "qproj"], "llama")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("peft.rank=0", "peft.rank=0"),
        ("peft.alpha=-1", "peft.alpha=-1"),
        ("peft.targets=[x_proj]", "'x_proj'"),
        ("peft.targets=[]", "peft.targets is empty"),
        ("precision.float8=tensorwise", "precision.float8=tensorwise with peft.method=lora"),
    ],
)
def test_bad_peft_config_is_one_line(override: str, key: str) -> None:
    cfg = compose(["peft=lora", override, "hardware=h100_80gb", "precision=bf16"]).cfg
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_qlora_refuses_fp16() -> None:
    cfg = compose(["peft=qlora", "precision=fp16"]).cfg
    with pytest.raises(ConfigError, match="peft.method=qlora with precision.param_dtype=fp16"):
        validate(cfg)


def test_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from dtlaunch.convert.base_fingerprint import fingerprint

    (tmp_path / "config.json").write_text(json.dumps({"a": 1}))
    w = {"x": torch.arange(20000.0)}
    save_file(w, str(tmp_path / "model.safetensors"))
    first = fingerprint(tmp_path)
    assert fingerprint(tmp_path) == first
    save_file({"x": w["x"] + 1}, str(tmp_path / "model.safetensors"))  # same header, other values
    assert fingerprint(tmp_path) != first


def test_peft_names_permute_q_lora_b_like_the_weight() -> None:
    from dtlaunch.convert.adapters import Adapters, from_peft_state, to_peft_state
    from dtlaunch.models.dense.hf import interleaved_to_halves

    cfg, _, _ = _meta([])
    a, b = torch.randn(8, 128), torch.randn(128, 8)
    ad = Adapters({"layers.0.attention.wq.lora_a": a, "layers.0.attention.wq.lora_b": b}, 2.0, {}, cfg.model)
    out = to_peft_state(ad)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    assert torch.equal(out[key + "A.weight"], a)
    assert torch.equal(out[key + "B.weight"], interleaved_to_halves(b, int(cfg.model.n_heads)))
    back = from_peft_state(out, cfg.model, "test")
    assert torch.equal(back["layers.0.attention.wq.lora_b"], b) and torch.equal(back["layers.0.attention.wq.lora_a"], a)


def test_the_default_targets_adapt_attention_where_the_mlp_is_routed_experts() -> None:
    """peft=lora's default names gate/up/down_proj; on an expert-only MLP (Mixtral) they are routed experts,
    which take no linear adapters: the default adapts the attention and says so (naming peft.target_experts,
    which adapts the experts themselves), an explicit list is refused naming it too."""
    job = ["recipe=tiny_ddp", "model=mixtral_8x7b", "peft=lora", "launch.nproc_per_node=1"]
    notes = validate(compose(job).cfg).notes
    want = (
        "routed experts, which take no adapters unless peft.target_experts=true: gate_proj, up_proj, down_proj skipped"
    )
    assert any(want in n for n in notes), notes
    assert not any("skipped" in n for n in validate(compose([*job, "peft.target_experts=true"]).cfg).notes)
    with pytest.raises(
        ConfigError,
        match="'gate_proj' is not a linear module of model.arch=mixtral \\(its routed experts take peft.target_experts=true\\)",
    ):
        validate(compose([*job, "peft.targets=[q_proj,gate_proj]"]).cfg)
