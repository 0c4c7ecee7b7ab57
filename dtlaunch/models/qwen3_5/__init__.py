"""Qwen3.5 dense (Qwen3_5ForCausalLM; the text decoder of Qwen3_5ForConditionalGeneration, e.g. Qwen3.5-9B,
27B): Qwen3-Next's hybrid decoder (Gated DeltaNet linear attention three blocks in four, gated full
attention with partial RoPE, (1 + gain) norms) with Qwen3.5's split Gated DeltaNet input projections and a
dense SwiGLU MLP in every block. The MoE sibling is dtlaunch/models/qwen3_5_moe/. Planned in closed form
(dtlaunch/models/qwen3_next/activations.py)."""

from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.qwen3_5.hf import Qwen3_5HF
from dtlaunch.models.qwen3_next.config import GatedDeltaNetModelConfig
from dtlaunch.models.qwen3_next.spec import hybrid_spec
from dtlaunch.models.registry import register

SPEC = register(
    hybrid_spec(
        dense_spec(
            "qwen3_5",
            "Qwen3.5 dense decoder (Gated DeltaNet and gated full attention, SwiGLU MLP)",
            Qwen3_5HF("Qwen3_5ForCausalLM", "qwen3_5_text", qk_norm=True),
            ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
            config=GatedDeltaNetModelConfig,
            check="dtlaunch.models.qwen3_next.check:check_dense",
            hf_names="dtlaunch.models.qwen3_5.names",
            qkv_bias=False,
            qk_norm=True,
            norm_offset=1.0,
            attention_output_gate=True,
        ),
        "dtlaunch.models.qwen3_5.model:build_model",
        split_projections=True,
    )
)
