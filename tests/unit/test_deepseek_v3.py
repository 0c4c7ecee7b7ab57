"""DeepSeek-V3 (model.arch=deepseek_v3) against transformers' DeepseekV3ForCausalLM on tiny random
directories (tests/conftest.py: GLM-4.5's routing parts, low-rank q, a 16-wide kv latent, 8 interleaved
rotated dims per head, no-RoPE / value widths 12 / 10): logits within 1e-5 in fp32, with the attention's
variants (a plain q projection, RoPE over halves, attention biases, YaRN), decoding from the latent KV
cache token by token (LoRA on wkv_b too) within 1e-5 of the whole forward (wkv_b's absorbed matrix computed
once, at the prefill, without LoRA's dropout), a bit-identical round trip,
the planner's exact count, the multi-token-prediction layer skipped, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hf_loaded import ours, round_trip, theirs, variant

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.registry import model_spec

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


def test_logits_match_transformers(tiny_moe_hf_dirs) -> None:
    path = tiny_moe_hf_dirs["deepseek_v3"]
    model, m = ours(path)
    assert m.arch == "deepseek_v3" and (m.q_lora_rank, m.kv_lora_rank) == (24, 16) and m.rope_interleave
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (12, 8, 10) and m.yarn is None
    assert (m.moe.num_experts, m.moe.n_group, m.moe.topk_group, m.moe.routed_scaling) == (8, 2, 1, 2.5)
    assert list(m.moe.dense_layers) == [0] and str(m.moe.score_func) == "sigmoid_bias"
    assert model.layers["1"].feed_forward.router.expert_bias.abs().max() > 0.1
    with torch.no_grad():
        diff = (model(TOKENS) - theirs(path)(TOKENS).logits).abs().max().item()
    assert diff < 1e-5, f"max |logit diff| {diff}"


@pytest.mark.parametrize(
    "changes",
    [
        {"q_lora_rank": None, "attention_bias": True},
        {"rope_interleave": False},
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.8,
                "mscale_all_dim": 0.7,
            }
        },
    ],
    ids=["plain_q_and_biases", "rope_halves", "yarn"],
)
def test_attention_variants_match_transformers(tiny_moe_hf_dirs, tmp_path, changes) -> None:
    """Each variant's logits within 1e-5 of transformers', and decoded token by token from the latent cache
    (mla.py: the prefill per head, the steps absorbed) within 1e-5 of the whole sequence's."""
    path = variant(tiny_moe_hf_dirs["deepseek_v3"], tmp_path, **changes)
    model, m = ours(path)
    with torch.no_grad():
        full = model(TOKENS)
        diff = (full - theirs(path)(TOKENS).logits).abs().max().item()
    assert diff < 1e-5, f"{changes}: max |logit diff| {diff}"
    assert (stepped(model, m)[0] - full).abs().max().item() < 1e-5


def stepped(model: torch.nn.Module, m) -> tuple[torch.Tensor, list]:
    """TOKENS' logits decoded with a cache per block: a 12-token prefill, then one token per step."""
    from dtlaunch.models.dense.model import KVCache

    caches = [KVCache() for _ in range(int(m.n_layers))]
    with torch.no_grad():
        steps = [model(TOKENS[:, :12], caches=caches)]
        steps += [model(TOKENS[:, i : i + 1], caches=caches) for i in range(12, TOKENS.shape[1])]
    return torch.cat(steps, dim=1), caches


def test_round_trip_is_bit_identical_and_counted_exactly(tiny_moe_hf_dirs, tmp_path) -> None:
    cfg = round_trip(tiny_moe_hf_dirs["deepseek_v3"], tmp_path, TOKENS)
    assert cfg["first_k_dense_replace"] == 1 and cfg["kv_lora_rank"] == 16 and cfg["num_nextn_predict_layers"] == 0


def test_multi_token_prediction_layer_is_skipped(tiny_moe_hf_dirs, tmp_path) -> None:
    """DeepSeek-V3 checkpoints carry layer n_layers (the MTP layer): skipped, as transformers skips it."""
    from safetensors.torch import load_file, save_file

    src = tiny_moe_hf_dirs["deepseek_v3"]
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(24, 64)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model, _ = ours(tmp_path)
    with torch.no_grad():
        assert (model(TOKENS) - ours(src)[0](TOKENS)).abs().max().item() == 0


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora_on_wkv_b"])
def test_decoding_with_the_cache_equals_the_full_forward(tiny_moe_hf_dirs, adapters: bool) -> None:
    """The latent cache (mla.py: the kv latent and the shared rotated key, attention absorbed) and the full
    per-head keys and values each give the logits of the whole sequence, token by token, within 1e-5; also
    with LoRA adapters on wkv_b (kv_b_proj, a default target), which the absorption reads through the module.
    The cache holds kv_lora_rank + qk_rope_head_dim values per position, no per-head keys or values."""
    from dtlaunch.models.deepseek_v3.mla import MLAttention
    from dtlaunch.models.lora import adapt_linear

    model, m = ours(tiny_moe_hf_dirs["deepseek_v3"])
    attention = [mod for mod in model.modules() if isinstance(mod, MLAttention)]
    if adapters:
        g = torch.Generator().manual_seed(5)
        for mod in attention:
            adapt_linear(mod.wkv_b, rank=2, alpha=4.0)
            with torch.no_grad():
                mod.wkv_b.lora_a.copy_(torch.randn(mod.wkv_b.lora_a.shape, generator=g) * 0.3)
                mod.wkv_b.lora_b.copy_(torch.randn(mod.wkv_b.lora_b.shape, generator=g) * 0.3)

    with torch.no_grad():
        full = model(TOKENS)
    for mod in attention:
        mod.latent_cache = False
    per_head, _ = stepped(model, m)
    for mod in attention:
        mod.latent_cache = True
    latent, caches = stepped(model, m)
    assert (per_head - full).abs().max().item() < 1e-5
    assert (latent - full).abs().max().item() < 1e-5
    width = int(m.kv_lora_rank) + int(m.qk_rope_head_dim)
    assert all(tuple(c.k.shape) == (2, TOKENS.shape[1], 1, width) and c.v.numel() == 0 for c in caches)


def test_decode_steps_read_wkv_b_matrix_once_without_lora_dropout(tiny_moe_hf_dirs) -> None:
    """The absorbed decode steps read wkv_b's matrix from the block's cache, computed once at the prefill
    (wkv_b runs twice per block in all: the prefill's latent and the identity; never in a decode step), and
    LoRA's dropout on wkv_b in training mode (on: the prefill's logits change) does not reach it: the cached
    matrix is the eval-mode module's on the identity, bit for bit, and base + scaling * B @ A."""
    from dtlaunch.models.deepseek_v3.mla import MLAttention
    from dtlaunch.models.lora import adapt_linear

    model, m = ours(tiny_moe_hf_dirs["deepseek_v3"])
    model.eval()
    attention = [mod for mod in model.modules() if isinstance(mod, MLAttention)]
    g = torch.Generator().manual_seed(5)
    calls = {id(mod.wkv_b): 0 for mod in attention}

    def count(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls[id(module)] += 1

    for mod in attention:
        adapt_linear(mod.wkv_b, rank=2, alpha=4.0, dropout=0.5)
        with torch.no_grad():
            mod.wkv_b.lora_a.copy_(torch.randn(mod.wkv_b.lora_a.shape, generator=g) * 0.3)
            mod.wkv_b.lora_b.copy_(torch.randn(mod.wkv_b.lora_b.shape, generator=g) * 0.3)
        mod.wkv_b.register_forward_hook(count)
    evaluated, _ = stepped(model, m)
    assert set(calls.values()) == {2}
    for mod in attention:
        mod.wkv_b.train()
    torch.manual_seed(0)
    dropped, caches = stepped(model, m)
    assert set(calls.values()) == {4}
    assert not torch.allclose(dropped[:, :12], evaluated[:, :12], atol=1e-3)  # the prefill's dropout
    for mod, cache in zip(attention, caches, strict=True):
        w = mod.wkv_b
        expected = (w.weight + w.scaling * w.lora_b @ w.lora_a).detach().t()
        with torch.no_grad():
            w.eval()
            assert torch.equal(cache.derived["wkv_b"], w(torch.eye(int(m.kv_lora_rank))))
        torch.testing.assert_close(cache.derived["wkv_b"], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim=7"),
        (["model.moe.dense_layers=[1]"], "its dense blocks first"),
        (["model.moe.score_func=softmax"], "model.arch=deepseek_v3"),
        (["strategy.cp=2"], "strategy.cp=2: model.arch=deepseek_v3"),
        (["strategy=tp", "model.n_heads=7", "model.n_kv_heads=7"], "model.n_heads=7 (num_attention_heads)"),
    ],
)
def test_refusals_name_the_family(overrides: list[str], fragment: str) -> None:
    small = ["model=deepseek_v3_671b", "model.n_layers=2", "model.moe.num_experts=8", "model.moe.top_k=2"]
    small += ["model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.dense_layers=[0]"]
    validate(compose(small).cfg)
    with pytest.raises(ConfigError) as err:
        validate(compose([*small, *overrides]).cfg)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("q_rank, query", [(24, "q_b_proj"), ("null", "q_proj")])
def test_default_lora_targets_adapt_the_latent_attention(q_rank, query: str) -> None:
    """peft=lora's default names q_proj and v_proj, which the latent attention does not have (a low-rank query's
    q_b_proj, the per-head keys and values' kv_b_proj): the family's own names join the default, so the
    attention is adapted, and the planner's adapter lines count the same linears the runtime adapts."""
    from dtlaunch.models.lora import select_targets
    from dtlaunch.models.registry import meta_model
    from dtlaunch.plan.peft import adapted, linears

    small = ["model=deepseek_v3_671b", "model.n_layers=2", "model.moe.num_experts=8", "model.moe.top_k=2"]
    small += ["model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.dense_layers=[0]", "peft=lora"]
    cfg = compose([*small, f"model.q_lora_rank={q_rank}"]).cfg
    spec = model_spec(cfg.model)
    chosen = select_targets(meta_model(cfg.model), spec, cfg.peft.targets, "deepseek_v3")
    names = {hf.rsplit(".", 1)[-1] for hf in chosen.values()}
    assert {query, "kv_b_proj", "o_proj"} <= names and not names & {"q_a_proj", "kv_a_proj_with_mqa"}, names
    lines = linears(cfg)
    assert lines is not None
    assert set(adapted(cfg, list(lines))) == {query, "kv_b_proj", "o_proj"} | (names & set(lines)), names
    validate(cfg)  # no note about skipped MLP names: the dense block's MLP takes the default's


# DeepSeek-V3's config.json as published (the keys that shape the model).
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_published_config_reads_as_deepseek_v3_671b_and_counts_exactly() -> None:
    """The published config.json reads as model=deepseek_v3_671b's fields, and the planner's count, the
    meta-built model's and transformers' agree (671.0B parameters without the MTP layer; 36.6B in the matmuls a token runs, head included)."""
    from dtlaunch.models.deepseek_v3.flops import matmul_params

    got = model_spec("deepseek_v3").hf.config_from_hf(PUBLISHED, "here")
    m = compose(["model=deepseek_v3_671b"]).cfg.model
    for key, value in got.items():
        if key in ("arch", "moe", "yarn"):
            continue
        assert value == getattr(m, key) or (value is None and key == "sliding_window"), key
    for key, value in got["moe"].items():
        assert value == getattr(m.moe, key) or str(value) == str(getattr(m.moe, key)), key
    assert got["yarn"] == {k: getattr(m.yarn, k) for k in got["yarn"]}
    config = transformers.DeepseekV3Config(**{k: v for k, v in PUBLISHED.items() if k != "rope_scaling"})
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    built = sum(p.numel() for p in model_spec(m).build(m, rope_len=8, device="meta").parameters())
    assert model_spec(m).param_count(m) == built == theirs
    # The config.json an export writes builds the same model in transformers (its YaRN parameters included).
    exported = model_spec(m).hf.config_to_hf(m)
    keep = {k: v for k, v in exported.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    again = transformers.DeepseekV3Config(**keep)
    assert again.rope_parameters["rope_type"] == "yarn" and again.rope_parameters["factor"] == 40.0
    with torch.device("meta"):
        assert transformers.AutoModelForCausalLM.from_config(again).num_parameters() == theirs
    assert (theirs, matmul_params(m)) == (671_026_404_352, 36_625_603_584)


@pytest.mark.parametrize(
    "q_rank, v_dim", [(24, 10), (None, 10), (24, 20)], ids=["low_rank_q", "plain_q", "v_as_wide_as_qk"]
)
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_planner_activation_terms_hold(mode: str, q_rank, v_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's saved bytes per block against what the runtime keeps (its StorageCounter from the first
    block's input to the last block's output, the runtime's AC), a dense block and a sparse one with every
    DeepSeek-V3 part on, fp32: exact without checkpointing, within 2 % selective (the experts' saved
    outputs depend on the router's split; the planner assumes a balanced one). Values narrower than q/k are
    padded for the fused kernel; as wide, they are not."""
    from types import SimpleNamespace

    from dtlaunch.models.deepseek_v3 import activations as act
    from dtlaunch.models.moe import experts
    from dtlaunch.train.observe.memtrack import StorageCounter
    from dtlaunch.train.parallel.ac import apply_ac

    monkeypatch.setattr(experts, "cpu_grouped_mm_dtypes", lambda: frozenset())
    batch, seq = 2, 64
    small = ["model=deepseek_v3_671b", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4"]
    small += ["model.vocab_size=256", "model.ffn_dim=96", "model.moe.num_experts=8", "model.moe.top_k=2"]
    small += ["model.moe.expert_dim=32", "model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.dense_layers=[0]"]
    small += [f"model.q_lora_rank={q_rank or 'null'}", "model.kv_lora_rank=16", "model.qk_rope_head_dim=8"]
    small += ["model.qk_nope_head_dim=12", f"model.v_head_dim={v_dim}", "model.max_seq_len=128"]
    m = compose(small).cfg.model
    torch.manual_seed(0)
    model = model_spec(m).build(m, rope_len=seq, device="cpu")
    model.init_weights(0)
    apply_ac(model, SimpleNamespace(activation_checkpointing=mode, ac_memory_budget=0.0, ac_policy="op"))
    counter = StorageCounter()
    counter.add_existing([*model.parameters(), *model.buffers()])
    marks: list[int] = []
    model.layers["0"].register_forward_pre_hook(lambda *_: marks.append(counter.live))
    model.layers["1"].register_forward_hook(lambda *_: marks.append(counter.live))
    with counter:
        model(torch.randint(0, 256, (batch, seq)))
    measured = marks[-1] - marks[0]
    predicted = act.block_bytes(act.BlockDims.of(m), 4, mode) * batch * seq * 2
    assert predicted == pytest.approx(measured, rel=0.02 if mode == "selective" else 1e-9)
