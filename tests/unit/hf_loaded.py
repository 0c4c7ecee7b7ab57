"""A tiny Hugging Face directory loaded both ways, for the families' parity tests: dtlaunch's model through
`model.init_from=hf:DIR` (every tensor and persistent buffer from the directory) and transformers' own."""

from __future__ import annotations

import torch

from dtlaunch.convert.hf import load_hf_weights
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec


def ours(path, seq: int = 32) -> tuple[torch.nn.Module, object]:
    m = compose(["model=tiny", f"model.init_from=hf:{path}"]).cfg.model
    model = model_spec(m).build(m, rope_len=seq, device="cpu")
    model.init_weights(0)  # buffers; the weights (and a router's correction bias) come next
    result = model.load_state_dict(load_hf_weights(path, m), strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    return model.eval(), m


def variant(src, tmp_path, **changes):
    """A random DeepSeek-V3 directory like `src` with some of config.json changed (weights perturbed, the
    router's correction bias too)."""
    import transformers

    config = transformers.DeepseekV3Config.from_pretrained(src)
    for k, v in changes.items():
        setattr(config, k, v)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    return tmp_path


def theirs(path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def round_trip(src, out_dir, tokens: torch.Tensor) -> dict:
    """Our model from `src` written back as a Hugging Face directory in `out_dir`: every tensor bit-identical
    to the source's, transformers' logits of both within 1e-5, our model's and `dtlaunch plan`'s counts
    transformers'.
    Returns the config.json written."""
    import json

    from cli_in_process import run_cli
    from safetensors.torch import load_file

    from dtlaunch.convert.hf import save_hf

    model, m = ours(src)
    save_hf({k: v for k, v in model.state_dict().items() if "rope" not in k}, m, out_dir)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    base = theirs(src)
    assert sum(p.numel() for p in model.parameters()) == base.num_parameters()
    with torch.no_grad():
        assert (theirs(out_dir)(tokens).logits - base(tokens).logits).abs().max().item() < 1e-5
    code, out = run_cli(["plan", f"model.init_from=hf:{src}"], stdout=True)
    assert code == 0, out
    assert f"(model.arch={m.arch}) from {src}: {base.num_parameters():,} parameters" in out, out
    return json.loads((out_dir / "config.json").read_text())


# Qwen3-Next-80B-A3B's published config.json shape (transformers.Qwen3NextConfig keyword arguments).
QWEN3_NEXT_80B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
