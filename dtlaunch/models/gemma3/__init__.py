"""Gemma 3 (text, Gemma3ForCausalLM): the dense decoder with four (1 + gain) RMSNorms per block, embeddings
scaled by sqrt(dim), a GELU-tanh gated MLP, per-head q/k norm, query_pre_attn_scalar as the attention
scale, and five sliding-window blocks in six (`model.layer_types`) whose RoPE has a base of its own."""

from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.gemma3.config import Gemma3ModelConfig
from dtlaunch.models.gemma3.hf import Gemma3HF
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "gemma3",
        "Gemma 3 text decoder (sandwich (1 + w) norms, scaled embeddings, GELU-tanh MLP, local/global layers)",
        Gemma3HF("Gemma3ForCausalLM", "gemma3_text", qk_norm=True, extra_config=(("attention_bias", False),)),
        ("Gemma3ForCausalLM",),
        config=Gemma3ModelConfig,
        check="dtlaunch.models.gemma3.check:check",
        hf_names="dtlaunch.models.gemma3.names",
        qkv_bias=False,
        qk_norm=True,
        sandwich_norm=True,
        norm_offset=1.0,
        embed_scale=True,
        mlp_activation="gelu_tanh",
    )
)
