"""LoRA on the routed experts (peft.target_experts), against Hugging Face peft's `target_parameters`.

Tiny random Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss, Qwen3-Next and Qwen3.5-MoE directories (tests/conftest.py):
our model, loaded from the directory with adapters on its attention and on every block's expert stacks
(random, B non-zero), must
compute the logits of transformers' model with our export (`ckpt export --format peft`'s tensors and
adapter_config.json) loaded by `peft.PeftModel.from_pretrained`; the merged export's weights likewise.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_loaded import ours

from dtlaunch.convert.adapters import Adapters, merge, peft_config, to_peft_state
from dtlaunch.errors import ConfigError
from dtlaunch.inputs.adapter_dir import ADAPTER_CONFIG, ADAPTER_FILE
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.lora import adapt_experts, adapt_linear, routed_expert_stacks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0


def _adapted(path):
    """Our model from `path` with random adapters on q_proj / v_proj and every expert stack, and them."""
    model, m = ours(path)
    g = torch.Generator().manual_seed(3)
    tensors, experts = {}, {}
    for fqn, mod in model.named_modules():
        # Qwen3-Next's and Qwen3.5's Gated DeltaNet blocks have no wq / wv: their input and output projections.
        gated_deltanet = ("attention.in_proj_qkvz", "attention.in_proj_qkv", "attention.out_proj")
        latent = ("attention.wq_b", "attention.wkv_b")  # DeepSeek-V3's per-head query and key/value projections
        if fqn.endswith(("attention.wq", "attention.wv", *gated_deltanet, *latent)):
            adapt_linear(mod, RANK, ALPHA)
            for leaf in ("lora_a", "lora_b"):
                p = getattr(mod, leaf)
                p.data = torch.randn(p.shape, generator=g) * 0.1
                tensors[f"{fqn}.{leaf}"] = p.data
    for fqn, mod in routed_expert_stacks(model).items():
        adapt_experts(mod, RANK, ALPHA)
        for leaf in ("lora_gate_up_a", "lora_gate_up_b", "lora_down_a", "lora_down_b"):
            p = getattr(mod, leaf)
            p.data = torch.randn(p.shape, generator=g) * 0.1
            experts[f"{fqn}.{leaf}"] = p.data
    record = {"method": "lora", "rank": RANK, "alpha": ALPHA, "dropout": 0.0, "base": f"hf:{path}"}
    return model.eval(), Adapters(tensors, ALPHA / RANK, record, m, {}, experts)


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v3"]
)
def test_expert_adapters_load_in_peft_with_our_logits(tiny_moe_hf_dirs, family: str, tmp_path) -> None:
    from safetensors.torch import save_file

    path = tiny_moe_hf_dirs[family]
    model, adapters = _adapted(path)
    out = tmp_path / "adapter"
    out.mkdir()
    save_file(to_peft_state(adapters), str(out / ADAPTER_FILE))
    config = peft_config(adapters)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (out / ADAPTER_CONFIG).write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = hf(tokens).logits
        with_peft = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        want = with_peft(tokens).logits
        got = model(tokens)
    assert (want - base).abs().max() > 1e-2  # the adapters change the output (peft applied them)
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()


def test_merged_experts_equal_the_adapted_model(tiny_moe_hf_dirs) -> None:
    model, adapters = _adapted(tiny_moe_hf_dirs["qwen3_moe"])
    base, _ = ours(tiny_moe_hf_dirs["qwen3_moe"])
    merged = merge(base.state_dict(), adapters, "test")
    stacks = routed_expert_stacks(model)
    for fqn, mod in stacks.items():
        w1, w2, w3 = mod.local_weights()
        for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
            assert torch.allclose(merged[f"{fqn}.{name}"], w, atol=1e-6), (fqn, name)
    assert math.isclose(adapters.scaling, ALPHA / RANK)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model=tiny"], "model.arch=llama has no routed experts: set peft.target_experts=false"),
        (["model=tiny_moe", "peft.dropout=0.1"], "peft.dropout=0.1 with peft.target_experts=true"),
        (["model=tiny_moe", "strategy=tp", "launch.nproc_per_node=2"], "peft.target_experts=true with strategy.tp=2"),
    ],
)
def test_target_experts_rules_are_one_line(overrides: list[str], fragment: str) -> None:
    base = ["peft=lora", "peft.targets=[wq,wv]", "peft.target_experts=true"]
    if overrides[0] == "model=tiny":
        base[1] = "peft.targets=[q_proj,v_proj]"
    with pytest.raises(ConfigError) as err:
        validate(compose([*base, *overrides]).cfg)
    assert "\n" not in str(err.value) and fragment in str(err.value), str(err.value)


def test_adapters_disabled_turns_the_experts_adapters_off_too(tiny_moe_hf_dirs) -> None:
    """DPO's reference with LoRA is the base model: every adapter off, the experts' included."""
    from dtlaunch.models.lora import adapters_disabled

    model, _ = _adapted(tiny_moe_hf_dirs["qwen3_moe"])
    base, _ = ours(tiny_moe_hf_dirs["qwen3_moe"])
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with adapters_disabled(model):
            off = model(tokens)
        on = model(tokens)
        want = base(tokens)
    assert torch.equal(off, want) and (on - want).abs().max() > 1e-2
