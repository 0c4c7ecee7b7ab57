"""Registry entries: published sizes exact (closed form, our meta model and transformers' own meta
model built from the same config.json), and the flags reach the modules."""

from __future__ import annotations

import pytest
import torch

from dtlaunch.convert.hf import hf_config
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import known_archs, model_spec
from dtlaunch.models.shapes import param_count

# Published totals (second-wave-facts.md: transformers' own config classes on the meta device).
PUBLISHED = {
    "qwen2.5_7b": 7_615_616_512,
    "qwen3_8b": 8_190_735_360,
    "mistral_7b": 7_248_023_552,
    "smollm3_3b": 3_075_098_624,
    "gemma3_1b": 999_885_952,
    "gpt_oss_20b": 20_914_757_184,
}
FAMILY_GROUPS = [
    "qwen2.5_0.5b",
    "qwen2.5_7b",
    "qwen2.5_72b",
    "qwen3_0.6b",
    "qwen3_8b",
    "qwen3_32b",
    "mistral_7b",
    "llama3.2_1b",
    "llama3.2_3b",
    "smollm3_3b",
    "gemma3_1b",
    "gpt_oss_20b",
]


def _transformers_count(m) -> int:
    """transformers' model for the config.json we would export, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    c = hf_config(m)
    config_cls = transformers.AutoConfig.for_model(c["model_type"]).__class__
    keep = {k: v for k, v in c.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    config = config_cls(**keep)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == c["architectures"][0]
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", FAMILY_GROUPS)
def test_family_sizes_match_transformers_and_published(name: str) -> None:
    m = compose([f"model={name}"]).cfg.model
    ours = sum(p.numel() for p in model_spec(m).build(m, rope_len=4, device="meta").parameters())
    assert ours == param_count(m)
    assert ours == _transformers_count(m)
    if name in PUBLISHED:
        assert ours == PUBLISHED[name]


def test_registry_has_the_native_families() -> None:
    assert {"llama", "qwen2", "qwen3", "mistral", "smollm3", "olmo3", "gemma3"} <= set(known_archs())


def test_flags_build_their_modules() -> None:
    m = compose(["model=tiny", "model.arch=qwen3", "model.qk_norm=true", "model.head_dim=32"]).cfg.model
    model = model_spec(m).build(m, rope_len=4, device="meta")
    attn = model.layers["0"].attention
    assert attn.q_norm.weight.shape == (32,) and attn.wq.weight.shape == (4 * 32, 64) and attn.wq.bias is None
    m = compose(["model=tiny", "model.arch=qwen2", "model.qkv_bias=true", "model.tie_embeddings=true"]).cfg.model
    model = model_spec(m).build(m, rope_len=4, device="meta")
    assert model.layers["0"].attention.wk.bias.shape == (32,) and model.layers["0"].attention.wo.bias is None
    assert model.output.weight is model.tok_embeddings.weight
    m = compose(["model=smollm3_3b", "model.n_layers=8"]).cfg.model
    model = model_spec(m).build(m, rope_len=4, device="meta")
    assert [i for i, b in model.layers.items() if not b.attention.rope] == ["3", "7"]
    m = compose(
        [
            "model=tiny",
            "model.arch=olmo3",
            "model.qk_norm=true",
            "model.sliding_window=8",
            "model.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]",
        ]
    ).cfg.model
    model = model_spec(m).build(m, rope_len=4, device="meta")
    assert [b.attention.sliding_window for b in model.layers.values()] == [8, None, 8, None]
    attn = model.layers["0"].attention
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,) and model.layers["0"].post_norm
    m = compose(["model=gemma3_1b", "model.n_layers=6"]).cfg.model
    model = model_spec(m).build(m, rope_len=4, device="meta")
    assert [b.attention.sliding_window for b in model.layers.values()] == [512] * 5 + [None]
    assert [b.attention.rope_columns.start for b in model.layers.values()] == [128] * 5 + [0]
    block = model.layers["5"]
    assert block.post_attention_norm.offset == block.attention.q_norm.offset == model.norm.offset == 1.0
    assert block.attention.q_scale == 1.0 and model.rope_cos.shape == (4, 256)  # both bases' tables


def test_plan_search_offers_olmo3_no_tensor_parallel() -> None:
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.search import candidates

    cfg = load_job(["model=tiny", "model.arch=olmo3", "model.qk_norm=true", "launch.nproc_per_node=4"]).cfg
    layouts = [lay for lay, _, _ in candidates(cfg)]
    assert layouts and {lay.tp for lay in layouts} == {1}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=qwen3_8b", "strategy=tp", "launch.nproc_per_node=3"], r"strategy.tp=3 does not divide .*qwen3"),
        (["model=llama3.2_1b", "strategy=pp", "launch.nproc_per_node=2"], r"tie_embeddings=true cannot run with"),
        (["model=tiny", "model.arch=qwen2"], r"model.qkv_bias=False does not fit model.arch=qwen2"),
        (
            ["model.arch=gpt2"],
            r"model.arch='gpt2' is not a registered model: use one of deepseek_v3, gemma3, glm4_moe, gpt_oss, hf_auto, llama, mistral, mixtral, moe, olmo3, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next, smollm3$",
        ),
        (
            ["model=tiny", "model.arch=olmo3", "model.qk_norm=true", "model.layer_types=[full_attention]"],
            r"model.layer_types=\['full_attention'\]: give one entry per block \(model.n_layers=4\)",
        ),
        (
            ["model=tiny", "model.arch=olmo3", "model.qk_norm=true", "strategy=tp", "launch.nproc_per_node=2"],
            r"strategy.tp=2 is not supported with model.arch=olmo3: its q/k RMSNorm spans every head .*use strategy.tp=1$",
        ),
        (
            ["model=tiny", "model.arch=smollm3", "model.no_rope_layers=[4]"],
            r"model.no_rope_layers=\[4\]: each entry .*0..3",
        ),
        (["model=tiny", "model.no_rope_layers=[3]"], r"no model.no_rope_layers: remove it, or use model.arch=smollm3"),
        (["model=gemma3_1b", "model.sandwich_norm=false"], r"model.sandwich_norm=False does not fit model.arch=gemma3"),
    ],
)
def test_bad_family_layouts_are_one_line_errors(overrides: list[str], message: str) -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides).cfg)
