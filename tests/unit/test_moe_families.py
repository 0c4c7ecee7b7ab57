"""Tiny random Qwen3-MoE, Mixtral and gpt-oss directories (made by transformers): loaded through
`model.init_from=hf:DIR`, our MoE decoder computes transformers' logits within 1e-4 and decodes its
greedy tokens; the published sizes count exactly the parameters of transformers' own meta models."""

from __future__ import annotations

import pytest
import torch
from hf_loaded import ours

from dtlaunch.convert.hf import HFWeights, load_hf_weights, save_hf
from dtlaunch.errors import InputError
from dtlaunch.infer.generate import generate_ids, load_source, set_positions
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec
from dtlaunch.models.shapes import param_count

transformers = pytest.importorskip("transformers")
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(tiny_moe_hf_dirs, family: str) -> None:
    path = tiny_moe_hf_dirs[family]
    model, m = ours(path)
    assert m.arch == family and m.moe.num_experts == 4 and m.moe.top_k == 2
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens) - ref(tokens).logits).abs().max().item()
    assert diff < 1e-4, f"{family}: max |logit diff| {diff}"
    # `dtlaunch generate hf:DIR --temperature 0` decodes with load_source + generate_ids.
    loaded = load_source(f"hf:{path}", torch.device("cpu"))
    prompt = [int(i) for i in loaded.tokenizer.encode(b"w3 w17 w42 w5 w99 w8")]
    set_positions(loaded.model, len(prompt) + 12)
    got = generate_ids(loaded.model, prompt, 12, eos_id=None)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got == want[0, len(prompt) :].tolist()


def test_gpt_oss_parity_round_trip_and_parts(tiny_moe_hf_dirs, tmp_path) -> None:
    """gpt-oss: transformers' fp32 logits within 1e-5; import -> export gives the original tensors bit for bit
    (the fused, interleaved gate_up_proj included) and a config.json transformers builds the same model from;
    each gpt-oss part changes the logits on these 20 tokens (so the parity checks it)."""
    import json

    from safetensors.torch import load_file

    src = tiny_moe_hf_dirs["gpt_oss"]
    model, m = ours(src)
    assert list(m.layer_types) == ["sliding_attention", "full_attention"] and m.sliding_window == 8
    assert (m.rope_yarn.factor, m.rope_yarn.original_max_seq_len, m.swiglu_limit) == (8.0, 16, 0.5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, tmp_path)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(tokens).logits
        assert (model(tokens) - want).abs().max().item() < 1e-5
        assert torch.equal(back(tokens).logits, want)
        full = model(tokens)
        attn, experts = model.layers["0"].attention, model.layers["0"].feed_forward.experts
        for part, undo in [
            ("window", lambda: setattr(attn, "sliding_window", None)),
            ("sinks", lambda: attn.sinks.fill_(-1e4)),  # exp(-1e4) = 0: no sink
            ("SwiGLU clamp", lambda: setattr(experts, "act", lambda g, u: (u + 1) * g * torch.sigmoid(1.702 * g))),
            ("YaRN", lambda: (model.rope_cos.copy_(model.rope_cos / 1.2079), model.rope_sin.div_(1.2079))),
        ]:
            undo()
            assert (model(tokens) - full).abs().max().item() > 1e-4, part
            full = model(tokens)


def test_gpt_oss_mxfp4_experts_are_dequantized_on_import(tiny_moe_hf_dirs, tmp_path) -> None:
    """A directory with MXFP4 experts (as openai/gpt-oss-* publish them: `*_blocks` / `*_scales`, here random
    codes): our model loaded from it computes transformers' logits (its dequantize=True load) within 1e-5,
    and a rank's slice of a dequantized tensor equals the full read's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, path = tiny_moe_hf_dirs["gpt_oss"], tmp_path / "mxfp4"
    shutil.copytree(src, path)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, cols = t.shape  # [experts, in, out]: 32 inputs per block of 16 bytes
            state[f"{name}_blocks"] = torch.randint(0, 256, (e, cols, rows // 32, 16), generator=g, dtype=torch.uint8)
            # Scales 2^-11..2^-4 (E8M0, bias 127): expert weights up to 6 x 2^-4, the published checkpoints' range;
            # scales up to 2^0 made weights of +-6 whose fp32 sums differed by 1.3e-5 between two kernel orders.
            state[f"{name}_scales"] = torch.randint(116, 124, (e, cols, rows // 32), generator=g, dtype=torch.uint8)
        else:
            state[name] = t
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    model, m = ours(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max().item() < 1e-5
    w = HFWeights(path, m)
    full = w.read("layers.1.feed_forward.experts.w3")
    assert torch.equal(w.read("layers.1.feed_forward.experts.w3", (2, 40, 64), (1, 8, 0)), full[1:3, 8:48])
    config["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(InputError, match=r"quant_method='gptq' is not read natively \(MXFP4 is\)"):
        model_spec("gpt_oss").hf.config_from_hf(config, "here")


@pytest.mark.parametrize("case", ["causal", "window", "decoding"])
def test_sink_attention_is_the_eager_softmax_with_sinks(case: str) -> None:
    """gpt-oss's sinks through SDPA (an extra key and query dim) give transformers' eager formula, softmax over
    [scores, sink] with the sink dropped, forward and gradients (sinks included), under GQA and masks."""
    from dtlaunch.models.dense.model import sink_attention

    def eager(q, k, v, mask, sinks):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = (q @ k.transpose(2, 3) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
        logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
        return logits.softmax(-1)[..., :-1] @ v

    g = torch.Generator().manual_seed(0)
    t = 9 if case == "decoding" else 6
    q, k, v = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, t, 16, generator=g), torch.randn(2, 2, t, 16)
    sinks = torch.randn(4, generator=g)
    qpos, kpos = torch.arange(t - 6, t)[:, None], torch.arange(t)[None]
    mask = kpos <= qpos
    given = {"causal": None, "window": mask & (kpos > qpos - 3), "decoding": mask[None, None].expand(2, 1, 6, t)}[case]
    inputs = [x.requires_grad_() for x in (q, k, v, sinks)]
    ours = sink_attention(*inputs[:3], given, inputs[3])
    ref = eager(*inputs[:3], mask if given is None else given, inputs[3])
    assert (ours - ref).abs().max().item() < 1e-6
    grads = torch.autograd.grad(ours.square().sum(), inputs), torch.autograd.grad(ref.square().sum(), inputs)
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_config_json_fills_the_moe_section(tiny_moe_hf_dirs) -> None:
    m = compose(["model=mixtral_8x7b", f"model.init_from=hf:{tiny_moe_hf_dirs['qwen3_moe']}"]).cfg.model
    assert (m.arch, m.dim, m.ffn_dim, m.moe.expert_dim, m.moe.norm_topk, list(m.moe.dense_layers)) == (
        "qwen3_moe",
        64,
        96,
        32,
        False,
        [1],
    )


def test_expert_slices_and_bad_tensors(tiny_moe_hf_dirs, tmp_path) -> None:
    """A rank's experts and rows, read from an index of shards, equal the full read's; a missing
    expert is named."""
    model, m = ours(tiny_moe_hf_dirs["qwen3_moe"])
    state = {k: v for k, v in model.state_dict().items() if "rope" not in k}
    save_hf(state, m, tmp_path / "sharded", max_shard_bytes=20_000)
    w = HFWeights(tmp_path / "sharded", m)
    full = w.read("layers.0.feed_forward.experts.w2")
    assert torch.equal(full, state["layers.0.feed_forward.experts.w2"])
    assert torch.equal(w.read("layers.0.feed_forward.experts.w2", (2, 64, 16), (1, 0, 16)), full[1:3, :, 16:])
    del state["layers.0.feed_forward.experts.w1"]
    save_hf(state, m, tmp_path / "missing")
    with pytest.raises(InputError, match=r"model.layers.0.mlp.experts.0.gate_proj.weight is missing"):
        load_hf_weights(tmp_path / "missing", m)


@pytest.mark.parametrize(
    "group,expected,cls,hf",
    [
        (
            "qwen3_30b_a3b",
            30_532_122_624,
            "Qwen3MoeConfig",
            dict(
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
                num_experts=128,
                num_experts_per_tok=8,
                tie_word_embeddings=False,
            ),
        ),
        (
            "mixtral_8x7b",
            46_702_792_704,
            "MixtralConfig",
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=32000,
                num_local_experts=8,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            ),
        ),
    ],
)
def test_published_sizes_count_exactly(group: str, expected: int, cls: str, hf: dict) -> None:
    config = getattr(transformers, cls)(**hf)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    m = compose([f"model={group}"]).cfg.model
    assert param_count(m) == theirs == expected
    assert sum(p.numel() for p in model_spec(m).build(m, rope_len=16, device="meta").parameters()) == expected


def test_balancing_overrides_are_free_shape_overrides_contradict(tiny_moe_hf_dirs) -> None:
    from dtlaunch.errors import ConfigError

    path = tiny_moe_hf_dirs["mixtral"]
    m = compose([f"model.init_from=hf:{path}", "model.moe.aux_loss_coef=0.01"]).cfg.model
    assert m.moe.aux_loss_coef == 0.01 and m.moe.num_experts == 4
    with pytest.raises(ConfigError, match=r"model.moe.top_k=3 contradicts .*config.json \(top_k=2\)"):
        compose([f"model.init_from=hf:{path}", "model.moe.top_k=3"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy.cp=2", "launch.nproc_per_node=2"], r"strategy.cp=2: model.arch=gpt_oss adds attention sinks"),
        (["model.attention_out_bias=false"], r"model.attention_out_bias=False with model.qkv_bias=True"),
        (["+model.rope_scaling.factor=8"], r"model.rope_scaling is Llama 3.1's, not gpt-oss's"),
    ],
)
def test_gpt_oss_refusals_are_one_line(overrides: list[str], message: str) -> None:
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.validate import validate

    with pytest.raises(ConfigError, match=message) as err:
        validate(compose(["model=gpt_oss_20b", "training.seq_len=16", *overrides]).cfg)
    assert "\n" not in str(err.value)
