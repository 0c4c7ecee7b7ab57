"""SmolLM3: the Llama-like dense decoder with NoPE layers (no RoPE on `model.no_rope_layers`, every
fourth layer in SmolLM3-3B) and a head tied to the embedding."""

from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.registry import register
from dtlaunch.models.smollm3.config import SmolLM3ModelConfig
from dtlaunch.models.smollm3.hf import SmolLM3HF

SPEC = register(
    dense_spec(
        "smollm3",
        "SmolLM3 decoder (GQA, NoPE layers without RoPE)",
        SmolLM3HF("SmolLM3ForCausalLM", "smollm3", extra_config=(("attention_bias", False), ("mlp_bias", False))),
        ("SmolLM3ForCausalLM",),
        config=SmolLM3ModelConfig,
        check="dtlaunch.models.smollm3.check:check",
        qkv_bias=False,
        qk_norm=False,
    )
)
