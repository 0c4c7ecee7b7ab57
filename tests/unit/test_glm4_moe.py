"""GLM-4.5 (model.arch=glm4_moe) against transformers' Glm4MoeForCausalLM on a tiny random directory
(tests/conftest.py: a dense first block, 8 experts in 2 groups, a shared expert, routed_scaling_factor
2.5, q/k/v biases, q/k norm, RoPE over half of each head, a non-zero correction bias): logits within
1e-5 in fp32, a bit-identical round trip, the planner's exact count, and the routing parts each mattering."""

from __future__ import annotations

import json

import pytest
import torch
from hf_loaded import ours, round_trip, theirs

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.registry import model_spec

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


def test_logits_match_transformers_and_every_part_matters(tiny_moe_hf_dirs) -> None:
    path = tiny_moe_hf_dirs["glm4_moe"]
    model, m = ours(path)
    assert m.arch == "glm4_moe" and m.qkv_bias and m.qk_norm and m.partial_rotary_factor == 0.5
    assert (m.moe.num_experts, m.moe.n_group, m.moe.topk_group, m.moe.routed_scaling) == (8, 2, 1, 2.5)
    assert list(m.moe.dense_layers) == [0] and str(m.moe.score_func) == "sigmoid_bias"
    router = model.layers["1"].feed_forward.router
    assert router.expert_bias.abs().max() > 0.1  # the directory's correction bias was loaded
    with torch.no_grad():
        full = model(TOKENS)
        diff = (full - theirs(path)(TOKENS).logits).abs().max().item()
        assert diff < 1e-5, f"max |logit diff| {diff}"
        bias = router.expert_bias.clone()
        for part, undo, redo in [
            ("correction bias", lambda: router.expert_bias.zero_(), lambda: router.expert_bias.copy_(bias)),
            ("groups", lambda: setattr(router, "n_group", 1), lambda: setattr(router, "n_group", 2)),
            ("scaling", lambda: setattr(router, "scale", 1.0), lambda: setattr(router, "scale", 2.5)),
        ]:
            undo()
            assert (model(TOKENS) - full).abs().max().item() > 1e-4, part
            redo()


def test_round_trip_is_bit_identical_and_counted_exactly(tiny_moe_hf_dirs, tmp_path) -> None:
    cfg = round_trip(tiny_moe_hf_dirs["glm4_moe"], tmp_path, TOKENS)
    assert cfg["first_k_dense_replace"] == 1 and cfg["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_multi_token_prediction_layer_is_skipped(tiny_moe_hf_dirs, tmp_path) -> None:
    """GLM-4.5 checkpoints carry layer n_layers (the MTP layer): skipped, as transformers skips it."""
    from safetensors.torch import load_file, save_file

    src = tiny_moe_hf_dirs["glm4_moe"]
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(96, 64)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model, _ = ours(tmp_path)
    with torch.no_grad():
        assert (model(TOKENS) - ours(src)[0](TOKENS)).abs().max().item() == 0


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.moe.n_group=3"], "model.moe.n_group=3 does not split"),
        (["model.moe.n_group=2", "model.moe.topk_group=3"], "model.moe.topk_group=3"),
        (["model.partial_rotary_factor=0.04"], "model.partial_rotary_factor=0.04"),
        (["model.moe.dense_layers=[1]"], "its dense blocks first"),
        (["model.moe.score_func=softmax"], "model.arch=glm4_moe"),
    ],
)
def test_refusals_name_the_family(overrides: list[str], fragment: str) -> None:
    small = ["model=glm4_5_air", "model.n_layers=2", "model.moe.num_experts=8", "model.moe.top_k=2"]
    validate(compose([*small, "model.moe.n_group=2"]).cfg)
    with pytest.raises(ConfigError) as err:
        validate(compose([*small, *overrides]).cfg)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_other_routers_are_unchanged() -> None:
    """Defaults (n_group=1, routed_scaling=1, softmax) take the router's old path: no bias, no groups."""
    from dtlaunch.models.moe.layer import Router

    torch.manual_seed(0)
    r = Router(16, 8, 2, "softmax", True, False)
    x = torch.randn(5, 16)
    w, ids, scores = r(x)
    ref_scores = r.gate(x).float().softmax(-1)
    ref_w, ref_ids = ref_scores.topk(2, dim=-1)
    assert torch.equal(ids, ref_ids) and torch.equal(scores, ref_scores)
    assert torch.equal(w, ref_w / ref_w.sum(-1, keepdim=True).clamp_min(1e-20)) and r.expert_bias is None


def test_glm4_5_air_counts_exactly() -> None:
    """model=glm4_5_air: the planner's count, the meta-built model's and transformers' from the published
    config.json agree (106.85B parameters; 12.8B in the matmuls a token runs, head included)."""
    from dtlaunch.models.moe.flops import matmul_params

    config = transformers.Glm4MoeConfig(
        hidden_size=4096,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151552,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=False,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    m = compose(["model=glm4_5_air"]).cfg.model
    built = sum(p.numel() for p in model_spec(m).build(m, rope_len=8, device="meta").parameters())
    assert model_spec(m).param_count(m) == built == theirs == 106_852_245_504
    assert matmul_params(m) == 12_803_366_912


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_planner_activation_terms_hold(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE planner's saved bytes per block hold with every GLM-4.5 part on (partial RoPE, q/k/v biases,
    q/k norm, a shared expert, the biased sigmoid router with groups and scaling): exact without
    checkpointing, within 2 % under selective (which depends on the router's split)."""
    from test_moe_activations import _kept_by_blocks

    from dtlaunch.models.moe import experts

    monkeypatch.setattr(experts, "cpu_grouped_mm_dtypes", lambda: frozenset())
    glm = [
        "model.arch=glm4_moe",
        "model.moe.score_func=sigmoid_bias",
        "model.moe.n_group=2",
        "model.moe.routed_scaling=2.5",
        "model.moe.num_shared_experts=1",
        "model.qkv_bias=true",
        "model.qk_norm=true",
    ]
    measured, predicted = _kept_by_blocks(glm, mode)
    assert predicted == pytest.approx(measured, rel=0.02 if mode == "selective" else 1e-9)


def test_published_config_json_reads_as_glm4_5_air() -> None:
    """GLM-4.5-Air's config.json as published (top-level rope_theta and partial_rotary_factor, the MTP layer
    count) reads as model=glm4_5_air's fields."""
    published = {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "partial_rotary_factor": 0.5,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "use_qk_norm": False,
        "vocab_size": 151552,
    }
    spec = model_spec("glm4_moe")
    got = spec.hf.config_from_hf(published, "here")
    m = compose(["model=glm4_5_air"]).cfg.model
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "qkv_bias", "qk_norm"):
        assert got[key] == getattr(m, key), key
    assert (got["rope_theta"], got["partial_rotary_factor"], got["norm_eps"]) == (1e6, 0.5, 1e-5)
    for key, value in got["moe"].items():
        assert value == getattr(m.moe, key) or str(value) == str(getattr(m.moe, key)), key
