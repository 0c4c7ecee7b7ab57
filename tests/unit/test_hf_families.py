"""Tiny random-weight Qwen2, Qwen3, Mistral, tied Llama, SmolLM3, OLMo 3 and Gemma 3 directories (made by transformers): our
model, loaded through `model.init_from=hf:DIR`, computes transformers' logits within 1e-5 (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from dtlaunch.convert.hf import load_hf_weights, save_hf
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.registry import model_spec

transformers = pytest.importorskip("transformers")
FAMILIES = ["qwen2", "qwen3", "mistral", "llama_tied", "smollm3", "olmo3", "gemma3"]
ARCH = {f: f for f in FAMILIES} | {"llama_tied": "llama"}


def ours(path, seq: int = 32) -> tuple[torch.nn.Module, object]:
    m = compose(["model=tiny", f"model.init_from=hf:{path}"]).cfg.model
    model = model_spec(m).build(m, rope_len=seq, device="cpu")
    model.init_weights(0)  # buffers; the weights come next
    state = load_hf_weights(path, m)
    missing = model.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"output.weight"}
    return model.eval(), m


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_hf_dirs, family: str) -> None:
    path = tiny_hf_dirs[family]
    model, m = ours(path)
    assert m.arch == ARCH[family] and m.dim == 64 and m.vocab_size == 256
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens) - ref(tokens).logits).abs().max().item()
    assert diff < 1e-5, f"{family}: max |logit diff| {diff}"


def test_smollm3_round_trip_is_bit_identical_and_counted_exactly(tiny_hf_dirs, tmp_path) -> None:
    """Import -> export (save_hf, what `ckpt export --format hf` writes) gives the original tensors bit for
    bit and a config.json transformers builds the same model from (NoPE layer 1 included: same logits);
    `dtlaunch plan` counts transformers' parameters exactly. (The DCP -> HF path is family-independent:
    tests/e2e/test_hf_families_train.py runs it per family.)"""
    from cli_in_process import run_cli
    from safetensors.torch import load_file

    src = tiny_hf_dirs["smollm3"]
    model, m = ours(src)
    assert list(m.no_rope_layers) == [1] and m.tie_embeddings
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, tmp_path)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["no_rope_layers"] == [1, 0] and cfg["pad_token_id"] is None  # 128004 is outside 256 ids
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        b = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        assert (a(tokens).logits - b(tokens).logits).abs().max().item() < 1e-5
    code, out = run_cli(["plan", f"model.init_from=hf:{src}"], stdout=True)
    assert code == 0, out
    assert f"(model.arch=smollm3) from {src}: {sum(p.numel() for p in b.parameters()):,} parameters" in out, out


def test_smollm3_config_json_variants(tiny_hf_dirs, tmp_path) -> None:
    """transformers' defaults when config.json omits them (NoPE every no_rope_layer_interval-th layer, tied
    head, theta 2e6); a window on the NoPE layers only is refused, one on every layer read."""
    c = json.loads((tiny_hf_dirs["smollm3"] / "config.json").read_text())
    spec = model_spec("smollm3")
    for key in ("no_rope_layers", "no_rope_layer_interval", "tie_word_embeddings", "rope_parameters", "rope_theta"):
        c.pop(key, None)
    c.pop("layer_types")
    fields = spec.hf.config_from_hf({**c, "no_rope_layer_interval": 1}, "here")
    assert (fields["no_rope_layers"], fields["tie_embeddings"], fields["rope_theta"]) == ([0, 1], True, 2e6)
    assert spec.hf.config_from_hf(c, "here")["no_rope_layers"] == []  # 2 layers, a NoPE layer every 4th
    window = {**c, "no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 8}
    with pytest.raises(InputError, match=r"here: sliding-window attention on some layers only .*model.arch=hf_auto"):
        spec.hf.config_from_hf(window, "here")
    every = {**window, "layer_types": ["sliding_attention"] * 2}
    assert spec.hf.config_from_hf(every, "here")["sliding_window"] == 8
    cfg = transformers.SmolLM3Config(
        **{
            k: v
            for k, v in spec.hf.config_to_hf(compose(["model=smollm3_3b"]).cfg.model).items()
            if k not in ("architectures", "model_type", "torch_dtype", "dtype")
        }
    )
    assert cfg.no_rope_layers == [int((i + 1) % 4 != 0) for i in range(36)] and cfg.pad_token_id == 128004


def test_olmo3_round_trip_is_bit_identical_and_counted_exactly(tiny_hf_dirs, tmp_path) -> None:
    """Import -> export gives the original tensors bit for bit (post-norm gains, whole-projection q/k norm
    gains permuted per head) and a config.json transformers builds the same model from (sliding layer 0,
    full layer 1: same logits on 20 tokens, past the window of 8); `dtlaunch plan` counts transformers'
    parameters exactly. The window matters: without it our logits move."""
    from cli_in_process import run_cli
    from safetensors.torch import load_file

    src = tiny_hf_dirs["olmo3"]
    model, m = ours(src)
    assert list(m.layer_types) == ["sliding_attention", "full_attention"] and m.sliding_window == 8
    assert m.post_norm and m.qk_norm and m.qk_norm_whole and not m.tie_embeddings
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, tmp_path)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 8
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        b = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        assert (a(tokens).logits - b(tokens).logits).abs().max().item() < 1e-5
        full = model(tokens)
        model.layers["0"].attention.sliding_window = None
        assert (model(tokens) - full).abs().max().item() > 1e-3
    code, out = run_cli(["plan", f"model.init_from=hf:{src}"], stdout=True)
    assert code == 0, out
    assert f"(model.arch=olmo3) from {src}: {sum(p.numel() for p in b.parameters()):,} parameters" in out, out


def test_olmo3_config_json_variants(tiny_hf_dirs) -> None:
    """transformers' defaults when config.json omits them (three sliding layers in four, window 4096, theta
    5e5, eps 1e-5); RoPE that differs between the layer kinds (OLMo 3's YaRN on full layers) is refused."""
    c = json.loads((tiny_hf_dirs["olmo3"] / "config.json").read_text())
    spec = model_spec("olmo3")
    for key in ("layer_types", "sliding_window", "rope_parameters", "rope_theta", "rms_norm_eps"):
        c.pop(key, None)
    fields = spec.hf.config_from_hf({**c, "num_hidden_layers": 4}, "here")
    assert fields["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert (fields["sliding_window"], fields["rope_theta"], fields["norm_eps"]) == (4096, 5e5, 1e-5)
    full = spec.hf.config_from_hf({**c, "layer_types": ["full_attention"] * 2}, "here")
    assert (full["sliding_window"], full["layer_types"]) == (None, [])
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    mixed = {**c, "rope_parameters": {"full_attention": yarn, "sliding_attention": {"rope_type": "default"}}}
    with pytest.raises(InputError, match=r"here: RoPE settings differ between full-attention .*model.arch=hf_auto$"):
        spec.hf.config_from_hf(mixed, "here")
    # transformers gives the top-level rope_theta to the full-attention layers only, and reads no flat dict.
    with pytest.raises(InputError, match=r"here: RoPE settings differ"):
        spec.hf.config_from_hf({**c, "rope_theta": 1e4}, "here")
    flat = {"rope_type": "default", "rope_theta": 5e5}
    assert spec.hf.config_from_hf({**c, "rope_parameters": flat}, "here")["rope_theta"] == 5e5
    with pytest.raises(InputError, match=r"here: rope_parameters=.* is one flat dict"):
        spec.hf.config_from_hf({**c, "rope_parameters": {**flat, "rope_theta": 1e4}}, "here")
    with pytest.raises(InputError, match=r"here: layer_types=.* needs one entry per layer"):
        spec.hf.config_from_hf({**c, "layer_types": ["sliding_attention"]}, "here")


def test_gemma3_round_trip_is_bit_identical_and_counted_exactly(tiny_hf_dirs, tmp_path) -> None:
    """Import -> export gives the original tensors bit for bit (four norms per block, per-head q/k norm gains
    permuted) and a config.json transformers builds the same model from; `dtlaunch plan` counts
    transformers' parameters exactly. Each Gemma part matters on the 20 tokens: the window of 8 on the
    sliding layer, its local RoPE base, the attention scale 1/sqrt(256) (head_dim 16), the embedding scale."""
    from cli_in_process import run_cli
    from safetensors.torch import load_file

    src = tiny_hf_dirs["gemma3"]
    model, m = ours(src)
    assert list(m.layer_types) == ["sliding_attention", "full_attention"] and m.sliding_window == 8
    assert (m.rope_theta, m.rope_local_theta, m.rope_linear_factor, m.query_pre_attn_scalar) == (1e6, 1e4, 2.0, 256)
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, tmp_path)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["rope_parameters"]["full_attention"]["rope_type"] == "linear"
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        b = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        assert (a(tokens).logits - b(tokens).logits).abs().max().item() < 1e-5
        full = model(tokens)
        attn = model.layers["0"].attention
        for part, undo in [
            ("window", lambda: setattr(attn, "sliding_window", None)),
            ("local RoPE base", lambda: setattr(attn, "rope_columns", slice(0, 8))),
            ("attention scale", lambda: setattr(attn, "q_scale", 1.0)),
            ("embedding scale", lambda: model.embed_factor.update({torch.float32: 1.0})),
        ]:
            undo()
            assert (model(tokens) - full).abs().max().item() > 1e-3, part
    code, out = run_cli(["plan", f"model.init_from=hf:{src}"], stdout=True)
    assert code == 0, out
    assert f"(model.arch=gemma3) from {src}: {sum(p.numel() for p in b.parameters()):,} parameters" in out, out


def test_gemma3_config_json_variants(tiny_hf_dirs) -> None:
    """Read as transformers' Gemma3TextConfig reads it: its defaults (five sliding layers in six, window
    4096, bases 1e6 / 1e4, head_dim 256, tied head), the older top-level keys (rope_theta,
    rope_local_base_freq, rope_scaling); what the decoder cannot run is refused naming hf_auto."""
    c = json.loads((tiny_hf_dirs["gemma3"] / "config.json").read_text())
    spec = model_spec("gemma3")
    for key in ("layer_types", "sliding_window", "rope_parameters", "head_dim", "tie_word_embeddings"):
        c.pop(key)
    fields = spec.hf.config_from_hf({**c, "num_hidden_layers": 7}, "here")
    assert fields["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (fields["sliding_window"], fields["head_dim"], fields["tie_embeddings"]) == (4096, 256, True)
    assert (fields["rope_theta"], fields["rope_local_theta"], fields["rope_linear_factor"]) == (1e6, 1e4, None)
    legacy = {
        **c,
        "rope_theta": 5e5,
        "rope_local_base_freq": 2e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    fields = spec.hf.config_from_hf(legacy, "here")
    assert (fields["rope_theta"], fields["rope_local_theta"], fields["rope_linear_factor"]) == (5e5, 2e4, 8.0)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "architectures"})
    assert theirs.rope_parameters["full_attention"]["rope_theta"] == 5e5
    assert theirs.rope_parameters["sliding_attention"]["rope_theta"] == 2e4
    for bad, message in [
        ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0 .*model.arch=hf_auto$"),
        ({"hidden_activation": "gelu"}, r"hidden_activation='gelu', .*gelu_pytorch_tanh: use model.arch=hf_auto$"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"RoPE 'yarn' \(full attention\).*hf_auto$"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=true .*hf_auto$"),
    ]:
        with pytest.raises(InputError, match=r"here: " + message):
            spec.hf.config_from_hf({**c, **bad}, "here")
    cp = ["model=gemma3_1b", "strategy.cp=2", "launch.nproc_per_node=2", "training.seq_len=4096"]
    with pytest.raises(
        ConfigError, match=r"strategy.cp=2: model.arch=gemma3 slides .*window=512 < training.seq_len=4096"
    ):
        validate(compose(cp).cfg)


def test_gemma3_lora_trains_its_adapters_only(tiny_hf_dirs) -> None:
    """LoRA on every Gemma 3 linear (q/k/v/o, gate/up/down, found by their Hugging Face names): at init the
    model still computes transformers' logits, five AdamW steps lower the loss through the adapters alone
    and the imported weights stay as read; `dtlaunch plan` plans the LoRA job from the directory."""
    from cli_in_process import run_cli

    from dtlaunch.models.lora import adapter_init, apply_lora

    src = tiny_hf_dirs["gemma3"]
    model, m = ours(src)
    cfg = compose(["model=tiny", f"model.init_from=hf:{src}", "peft=lora", LORA_TARGETS]).cfg
    chosen = apply_lora(model, model_spec(m), cfg.peft)
    assert len(chosen) == 2 * 7
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(adapter_init(name, tuple(p.shape), seed=0))
    tokens = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(tokens[:, :-1]) - ref(tokens[:, :-1]).logits).abs().max().item() < 1e-5
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    code, out = run_cli(["plan", f"model.init_from=hf:{src}", "peft=lora", LORA_TARGETS], stdout=True)
    assert code == 0 and "(model.arch=gemma3)" in out, out


LORA_TARGETS = "peft.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def test_config_json_fills_the_model_section(tiny_hf_dirs) -> None:
    m = compose(["model=llama3_8b", f"model.init_from=hf:{tiny_hf_dirs['qwen3']}"]).cfg.model
    assert (m.arch, m.dim, m.head_dim, m.qk_norm, m.n_kv_heads, m.ffn_dim) == ("qwen3", 64, 24, True, 2, 96)
    assert m.rope_scaling is None  # the recipe's Llama-3.1 scaling is gone with its group
    m = compose(["model=tiny", f"model.init_from=hf:{tiny_hf_dirs['mistral']}"]).cfg.model
    assert m.sliding_window == 8 and m.arch == "mistral"


def test_contradicting_override_names_both_values(tiny_hf_dirs) -> None:
    with pytest.raises(ConfigError, match=r"model.dim=128 contradicts .*config.json \(dim=64\)"):
        compose(["model=tiny", "model.dim=128", f"model.init_from=hf:{tiny_hf_dirs['qwen2']}"])


def test_unknown_architecture_names_known_ones_and_hf_auto(tiny_hf_dirs, tmp_path) -> None:
    c = json.loads((tiny_hf_dirs["qwen2"] / "config.json").read_text())
    c["architectures"] = ["Phi3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=r"Phi3ForCausalLM .*Qwen3ForCausalLM.*model.arch=hf_auto"):
        compose([f"model.init_from=hf:{tmp_path}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy.tp=2"],
            r"strategy.sequence_parallel=true: model.arch=hf_auto .*set strategy.sequence_parallel=false",
        ),
        (["strategy.tp=4"], r"strategy.tp=4 does not divide num_key_value_heads=2 of .*choose a tp that divides it"),
        (["strategy.pp=2"], r"strategy.pp=2: model.arch=hf_auto has no pipeline split: use strategy.pp=1"),
    ],
)
def test_hf_auto_layout_errors(tiny_hf_dirs, overrides: list[str], message: str) -> None:
    sp = [] if "strategy.tp=2" in overrides else ["strategy.sequence_parallel=false"]
    with pytest.raises(ConfigError, match=message):
        validate(compose([*overrides, *sp, "model.arch=hf_auto", f"model.init_from=hf:{tiny_hf_dirs['qwen3']}"]).cfg)


def test_tied_head_cannot_be_split_over_pipeline_stages(tiny_hf_dirs) -> None:
    over = ["strategy=pp", "launch.nproc_per_node=2", f"model.init_from=hf:{tiny_hf_dirs['llama_tied']}"]
    with pytest.raises(
        ConfigError, match=r"model.tie_embeddings=true cannot run with strategy.pp=2 .*use strategy.pp=1"
    ):
        validate(compose(over).cfg)


def test_hf_auto_tensor_parallel_needs_the_models_plan(tmp_path) -> None:
    """Falcon's config class carries no base_model_tp_plan: tp > 1 is refused, naming strategy.tp=1;
    Phi-3's gathered fused projections need no head divisibility."""
    transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    ).save_pretrained(tmp_path / "falcon")
    args = ["strategy.tp=2", "strategy.sequence_parallel=false", "model.arch=hf_auto"]
    with pytest.raises(
        ConfigError, match=r"strategy.tp=2: model_type=falcon has no base_model_tp_plan .*use strategy.tp=1$"
    ):
        validate(compose([*args, f"model.init_from=hf:{tmp_path / 'falcon'}"]).cfg)
    transformers.Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=3, vocab_size=256).save_pretrained(
        tmp_path / "phi3"
    )
    assert validate(compose([*args, f"model.init_from=hf:{tmp_path / 'phi3'}"]).cfg).layout.tp == 2


def test_bad_tensors_are_named(tiny_hf_dirs, tmp_path) -> None:
    model, m = ours(tiny_hf_dirs["qwen2"])
    state = {k: v for k, v in model.state_dict().items() if "rope" not in k}
    save_hf({k: v for k, v in state.items() if k != "layers.1.attention.wk.bias"}, m, tmp_path / "missing")
    with pytest.raises(InputError, match=r"model.layers.1.self_attn.k_proj.bias is missing"):
        load_hf_weights(tmp_path / "missing", m)
    bad = dict(state, **{"layers.0.feed_forward.w1.weight": torch.zeros(8, 64)})
    save_hf(bad, m, tmp_path / "shape")
    with pytest.raises(InputError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(8, 64\)"):
        load_hf_weights(tmp_path / "shape", m)


def test_sharded_read_is_a_slice_of_the_full_tensor(tiny_hf_dirs, tmp_path) -> None:
    """A rank's block of a RoPE-permuted tensor, read from an index of shards, equals the full read's."""
    from dtlaunch.convert.hf import HFWeights

    model, m = ours(tiny_hf_dirs["qwen3"])
    state = {k: v for k, v in model.state_dict().items() if "rope" not in k}
    save_hf(state, m, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    w = HFWeights(tmp_path / "sharded", m)
    full = w.read("layers.1.attention.wq.weight")
    assert torch.equal(full, state["layers.1.attention.wq.weight"])
    assert torch.equal(w.read("layers.1.attention.wq.weight", (30, 64), (17, 0)), full[17:47])
    assert torch.equal(
        w.read("layers.0.attention.k_norm.weight", (12,), (12,)), state["layers.0.attention.k_norm.weight"][12:]
    )
