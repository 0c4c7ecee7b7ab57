"""Qwen3.5 (model.arch=qwen3_5, dense; qwen3_5_moe) against transformers on tiny random directories: the
text-only Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (tests/conftest.py) and the multimodal
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration with a tiny vision tower (here), each a
Gated DeltaNet block with split input projections then a gated full-attention block. Logits within 1e-5 in
fp32 over 80 tokens (the chunked delta rule crosses its 64-token chunk), bit-identical round trips of every
text tensor, the published experts' fused layout, exact parameter counts of the published shapes, greedy
decoding (recurrent state and KV cache) equal to transformers', packed documents (data.document_mask) each
equal to itself alone (ours and transformers', logits and gradients), and the layouts it cannot take refused
in one line naming the family."""

from __future__ import annotations

import json

import pytest
import torch
from hf_loaded import ours, round_trip, theirs
from test_qwen3_next import _flat, documents_data, packed_documents_are_each_alone

from dtlaunch.convert.hf import HFWeights, load_hf_weights, save_hf
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.registry import model_spec

transformers = pytest.importorskip("transformers")
# Longer than the Gated DeltaNet's 64-token chunk; 256: the tiny vocabulary.
TOKENS = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(0))
SEQ = 96  # our RoPE tables' length
# A vision tower as small as transformers builds one; no test feeds it an image.
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
VISION |= {"patch_size": 4, "num_position_embeddings": 16}
MULTIMODAL = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}  # family -> transformers' class prefix


@pytest.fixture(scope="module")
def text_dirs(tiny_hf_dirs, tiny_moe_hf_dirs) -> dict:
    return {"qwen3_5": tiny_hf_dirs["qwen3_5"], "qwen3_5_moe": tiny_moe_hf_dirs["qwen3_5_moe"]}


@pytest.fixture(scope="module")
def multimodal_dirs(text_dirs, tmp_path_factory) -> dict:
    """family -> a *ForConditionalGeneration directory whose text decoder has the text directory's config,
    and "qwen3_5_moe_fused": that MoE directory as Qwen publishes it (fused experts, an mtp block)."""
    from safetensors.torch import load_file, save_file

    out = {}
    for i, (family, prefix) in enumerate(MULTIMODAL.items()):
        text = json.loads((text_dirs[family] / "config.json").read_text())
        text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "dtype")}
        config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=VISION)
        torch.manual_seed(300 + i)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out[family] = tmp_path_factory.mktemp(family) / "multimodal"
        model.save_pretrained(out[family])
    src, fused = out["qwen3_5_moe"], tmp_path_factory.mktemp("published") / "qwen3_5_moe"
    fused.mkdir()
    (fused / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    for layer in (0, 1):
        mlp = f"model.language_model.layers.{layer}.mlp.experts"
        per = [[state.pop(f"{mlp}.{e}.{p}_proj.weight") for p in ("gate", "up", "down")] for e in range(4)]
        state[f"{mlp}.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u, _ in per])  # [E, 2F, dim]
        state[f"{mlp}.down_proj"] = torch.stack([d for _, _, d in per])  # [E, dim, F]
    state["mtp.fc.weight"] = torch.randn(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    out["qwen3_5_moe_fused"] = fused
    return out


def _multimodal(path):
    c = json.loads((path / "config.json").read_text())
    return getattr(transformers, c["architectures"][0]).from_pretrained(path, dtype=torch.float32).eval()


def _diff(path, reference) -> float:
    model, _ = ours(path, seq=SEQ)
    with torch.no_grad():
        return (model(TOKENS) - reference(TOKENS).logits).abs().max().item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_logits_match_transformers(text_dirs, multimodal_dirs, family) -> None:
    model, m = ours(text_dirs[family], seq=SEQ)
    assert m.arch == family and list(m.layer_types) == ["linear_attention", "full_attention"]
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.partial_rotary_factor) == (2, 4, 0.5)
    assert type(model.layers["0"].attention).__name__ == "GatedDeltaNet" and model.layers["0"].attention.in_proj_qkv
    diffs = {"text": _diff(text_dirs[family], theirs(text_dirs[family]))}
    diffs["multimodal"] = _diff(multimodal_dirs[family], _multimodal(multimodal_dirs[family]))
    if family == "qwen3_5_moe":
        published = _multimodal(multimodal_dirs["qwen3_5_moe_fused"])
        diffs["published"] = _diff(multimodal_dirs["qwen3_5_moe_fused"], published)
        with torch.no_grad():  # the fused directory is the same model to transformers too
            assert torch.equal(published(TOKENS).logits, _multimodal(multimodal_dirs[family])(TOKENS).logits)
    print(f"{family}: max |logit diff| {diffs}")
    assert max(diffs.values()) < 1e-5, diffs


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_round_trip_is_bit_identical_and_counted_exactly(text_dirs, family, tmp_path) -> None:
    cfg = round_trip(text_dirs[family], tmp_path, TOKENS[:, :20])
    assert cfg["architectures"] == [f"{MULTIMODAL[family]}ForCausalLM"] and cfg["layer_types"][0] == "linear_attention"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_fused"])
def test_multimodal_exports_its_text_decoder(multimodal_dirs, family, tmp_path) -> None:
    """The text decoder's every tensor written back bit for bit under Qwen3_5(Moe)ForCausalLM's names (per
    expert, from the fused layout too), the vision tower and mtp block left out; transformers loads the export
    with AutoModelForCausalLM and computes the multimodal model's logits."""
    from safetensors.torch import load_file

    arch = family.removesuffix("_fused")
    model, m = ours(multimodal_dirs[family], seq=SEQ)
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, tmp_path)
    source = load_file(str(multimodal_dirs[arch] / "model.safetensors"))  # the per-expert twin of the fused one
    text = {k.replace("model.language_model.", "model."): t for k, t in source.items() if "visual" not in k}
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(text) and all(torch.equal(exported[k], t) for k, t in text.items())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [f"{MULTIMODAL[arch]}ForCausalLM"] and "text_config" not in config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == f"{MULTIMODAL[arch]}ForCausalLM"
    with torch.no_grad():
        diff = (loaded(TOKENS).logits - _multimodal(multimodal_dirs[family])(TOKENS).logits).abs().max().item()
    assert diff < 1e-5, diff


def test_fused_experts_are_read_slice_by_slice(multimodal_dirs) -> None:
    """A rank holding some experts' rows (FSDP, EP) reads them from the fused tensors: the per-expert read's."""
    m = compose(["model=tiny", f"model.init_from=hf:{multimodal_dirs['qwen3_5_moe_fused']}"]).cfg.model
    fused, per_expert = HFWeights(multimodal_dirs["qwen3_5_moe_fused"], m), HFWeights(multimodal_dirs["qwen3_5_moe"], m)
    for name in ("w1", "w2", "w3"):
        name = f"layers.1.feed_forward.experts.{name}"
        full = per_expert.read(name)
        assert torch.equal(fused.read(name), full)
        assert torch.equal(fused.read(name, (2, 5, 7), (1, 3, 4)), full[1:3, 3:8, 4:11])


def test_tied_multimodal_ties_by_its_top_level_key(multimodal_dirs, tmp_path) -> None:
    """Qwen3_5ForConditionalGeneration ties its head by the top level's tie_word_embeddings (its text_config
    says false): so does the import, and the logits are transformers'."""
    config = json.loads((multimodal_dirs["qwen3_5"] / "config.json").read_text())
    config = transformers.Qwen3_5Config(**{**config, "tie_word_embeddings": True})
    torch.manual_seed(5)
    transformers.Qwen3_5ForConditionalGeneration(config).float().save_pretrained(tmp_path)
    m = compose(["model=tiny", f"model.init_from=hf:{tmp_path}"]).cfg.model
    assert m.tie_embeddings and not json.loads((tmp_path / "config.json").read_text())["text_config"].get(
        "tie_word_embeddings"
    )
    model = model_spec(m).build(m, rope_len=SEQ, device="cpu")
    model.init_weights(0)
    assert model.load_state_dict(load_hf_weights(tmp_path, m), strict=False).missing_keys == ["output.weight"]
    with torch.no_grad():
        diff = model.eval()(TOKENS) - _multimodal(tmp_path)(TOKENS).logits
    assert diff.abs().max().item() < 1e-5


def test_a_multimodal_config_is_checked_by_its_text_config(multimodal_dirs, tmp_path) -> None:
    """The layer count its text_config says, against the text decoder's layers (not the vision tower's)."""
    import shutil

    from dtlaunch.errors import InputError

    shutil.copytree(multimodal_dirs["qwen3_5"], tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 3
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises((ConfigError, InputError), match="num_hidden_layers=3 but the weights hold 2 layers"):
        compose(["model=tiny", f"model.init_from=hf:{tmp_path / 'd'}"])


def test_plan_says_the_vision_tower_is_skipped(multimodal_dirs) -> None:
    from cli_in_process import run_cli

    code, out = run_cli(["plan", f"model.init_from=hf:{multimodal_dirs['qwen3_5']}"], stdout=True)
    text_count = sum(p.numel() for p in ours(multimodal_dirs["qwen3_5"])[0].parameters())
    assert code == 0 and f"(model.arch=qwen3_5) from {multimodal_dirs['qwen3_5']}: {text_count:,} parameters" in out
    assert "its text decoder only (the vision tower, model.visual.*, is skipped)" in out, out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_published_shape_is_counted_exactly(family) -> None:
    """transformers' default configs, Qwen3.5-9B's and Qwen3.5-35B-A3B's shapes (meta device: no memory): our
    count equals transformers' text model's and the multimodal model's text decoder's, from either config."""
    prefix = MULTIMODAL[family]
    text, full = getattr(transformers, f"{prefix}TextConfig")(), getattr(transformers, f"{prefix}Config")()
    with torch.device("meta"):
        want = transformers.AutoModelForCausalLM.from_config(text).num_parameters()
        multimodal = getattr(transformers, f"{prefix}ForConditionalGeneration")(full)
    assert want == sum(p.numel() for n, p in multimodal.named_parameters() if not n.startswith("model.visual."))
    hf = model_spec(family).hf
    fields = hf.config_from_hf(text.to_dict(), "x")
    assert hf.config_from_hf(full.to_dict(), "x") == fields
    m = compose(["model=tiny", f"model.arch={family}", *_flat("model", fields)]).cfg.model
    assert model_spec(m).param_count(m) == want


def _until_stop(ids: list[int]) -> list[int]:
    return ids[: ids.index(1) + 1] if 1 in ids else ids


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_decoding_is_transformers(text_dirs, multimodal_dirs, family) -> None:
    """Two prompts of different lengths decoded together (left padding: the recurrent state and KV cache
    of Decoder.decoding_cache with a key mask) give each prompt's greedy continuation by transformers, the
    multimodal model's too (its three position streams on text)."""
    from dtlaunch.infer.batch_generate import Sampling, generate_batch

    prompts = [[5, 17, 42, 9, 99, 8, 3, 60, 61], [11, 12, 13]]
    for path, reference in ((text_dirs[family], theirs), (multimodal_dirs[family], _multimodal)):
        model, _ = ours(path, seq=32)
        got = generate_batch(model, prompts, Sampling(max_new_tokens=12, temperature=0.0), {1}).completions
        reference = reference(path)
        for prompt, ids in zip(prompts, got, strict=True):
            with torch.no_grad():
                out = reference.generate(
                    torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1
                )
            assert ids == _until_stop(out[0, len(prompt) :].tolist()), (type(reference).__name__, prompt)


def test_split_gated_deltanet_is_transformers_layer() -> None:
    """The layer alone, unit-variance random weights (outputs of order 1): transformers' Qwen3_5GatedDeltaNet's
    names and shapes, its output over 130 tokens (three chunks) and gradients, and its cached decoding."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from dtlaunch.models.qwen3_next.gated_deltanet import GatedDeltaNet, RecurrentState

    widths = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
    widths |= {"linear_value_head_dim": 6, "linear_conv_kernel_dim": 4}
    config = transformers.Qwen3_5TextConfig(hidden_size=32, rms_norm_eps=1e-6, num_hidden_layers=1, **widths)
    torch.manual_seed(0)
    theirs = Qwen3_5GatedDeltaNet(config, 0).float()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.01, 16).log() if name == "A_log" else torch.randn_like(p))
            if p.dim() > 1:
                p.mul_(p[0].numel() ** -0.5)
    mine = GatedDeltaNet(SimpleNamespace(dim=32, norm_eps=1e-6, **widths), split_projections=True)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 130, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    empty = torch.empty(0)
    results = []
    for layer, out in ((theirs, theirs(x)), (mine, mine(x, empty, empty))):
        names, params = zip(*sorted(layer.named_parameters()), strict=True)
        grads = torch.autograd.grad(out.square().sum(), [x, *params])
        results.append({"output": out.detach(), "input": grads[0], **dict(zip(names, grads[1:], strict=True))})
    assert results[0].keys() == results[1].keys()
    for name, want in results[0].items():
        torch.testing.assert_close(results[1][name], want, rtol=0, atol=1e-4, msg=name)
    cache, hf_cache = RecurrentState(), transformers.DynamicCache(config=config)
    with torch.no_grad():
        want = [theirs(x[:, :6], cache=hf_cache)] + [theirs(x[:, t : t + 1], cache=hf_cache) for t in range(6, 9)]
        got = [mine(x[:, :6], empty, empty, cache=cache)] + [
            mine(x[:, t : t + 1], empty, empty, cache=cache) for t in range(6, 9)
        ]
    torch.testing.assert_close(torch.cat(got, dim=1), torch.cat(want, dim=1), rtol=0, atol=1e-5)


def test_packed_documents_are_each_alone(text_dirs) -> None:
    """The split Gated DeltaNet under the dense decoder: test_qwen3_next's packed row, ours and transformers'."""
    packed_documents_are_each_alone(text_dirs["qwen3_5"])


def test_compiled_blocks_run_packed_documents_eagerly_without_recompiling(monkeypatch) -> None:
    """training.compile with data.document_mask: the Gated DeltaNet's documents path runs eagerly, as the
    dense attention does (parallelize.apply_compile), so new document lengths reuse the compiled blocks;
    loss and gradients are eager's. Dynamo's eager backend: the graph breaks and guards are Inductor's."""
    import copy

    import torch._dynamo

    import dtlaunch.train.parallel.parallelize as parallelize

    kinds = ["model.n_layers=2", "model.layer_types=[linear_attention,full_attention]"]
    heads = ["model.linear_num_key_heads=2", "model.linear_num_value_heads=4"]
    heads += ["model.linear_key_head_dim=8", "model.linear_value_head_dim=8"]
    m = compose(["model=tiny", "model.arch=qwen3_5", *kinds, *heads]).cfg.model
    eager = model_spec(m).build(m, rope_len=80, device="cpu")
    eager.init_weights(0)
    compiled = copy.deepcopy(eager)
    monkeypatch.setattr(parallelize, "compile_backend", lambda: "eager")
    parallelize.apply_compile(compiled, documents=True)
    torch._dynamo.reset()
    for i, lengths in enumerate([(70, 10), (5, 60, 15)]):
        tokens = torch.randint(0, 200, (1, 80), generator=torch.Generator().manual_seed(i))
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        extra = {"positions": torch.cat([torch.arange(n) for n in lengths])[None], "doc_ids": doc_ids}
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(tokens, **extra).square().mean()
        want = eager(tokens, **extra).square().mean()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
        compiled.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_context_parallel_as_ulysses_is_accepted(multimodal_dirs, family) -> None:
    cp = ["strategy.cp=2", "strategy.cp_style=ulysses", "launch.nproc_per_node=2"]
    validate(compose([f"model.init_from=hf:{multimodal_dirs[family]}", "training.seq_len=16", *cp]).cfg)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_document_mask_is_taken(multimodal_dirs, family, tiny_tokenizer, tmp_path) -> None:
    data = documents_data(tmp_path, tiny_tokenizer)
    validate(compose([f"model.init_from=hf:{multimodal_dirs[family]}", "training.seq_len=16", *data]).cfg)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["strategy=tp", "launch.nproc_per_node=3"],
            r"^strategy.tp=3 does not divide model.linear_num_key_heads=2 \(model.arch={}\)",
        ),
        (
            [
                "strategy=tp",
                "launch.nproc_per_node=2",
                "precision=bf16",
                "precision.float8=tensorwise",
                "precision.float8_emulate=true",
            ],
            r"^precision.float8=tensorwise with strategy.tp=2: model.arch={}'s Gated DeltaNet",
        ),
        (
            ["strategy.cp=2", "launch.nproc_per_node=2"],
            r"^strategy.cp_style=ring with strategy.cp=2: model.arch={}'s .*set strategy.cp_style=ulysses$",
        ),
        (
            ["strategy.cp=2", "strategy.cp_style=ulysses", "strategy.tp=2", "launch.nproc_per_node=4"],
            r"^strategy.cp=2 does not divide model.linear_num_key_heads=2 \(1 per tensor-parallel rank\): ",
        ),
        (
            ["peft=lora", "peft.targets=[in_proj_qkv,out_proj]", "strategy=tp", "launch.nproc_per_node=2"],
            r"^peft.targets names in_proj_qkv with strategy.tp=2: model.arch={}'s in_proj_qkv is gathered whole",
        ),
        (
            ["peft=lora", "peft.targets=[all-linear]", "strategy=tp", "launch.nproc_per_node=2"],
            r"^peft.targets names all-linear with strategy.tp=2: .*name the linears without it, or set strategy.tp=1$",
        ),
        (["objective.generation_compile=true"], r"^objective.generation_compile=true: model.arch={}'s linear blocks"),
    ],
)
def test_what_it_cannot_do_is_one_line(multimodal_dirs, family, extra, message) -> None:
    job = compose([f"model.init_from=hf:{multimodal_dirs[family]}", "training.seq_len=16", *extra])
    with pytest.raises(ConfigError, match=message.format(family)) as err:
        validate(job.cfg)
    assert "\n" not in str(err.value)
