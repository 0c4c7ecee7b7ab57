"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM; the text decoder of Qwen3_5MoeForConditionalGeneration, e.g.
Qwen3.5-35B-A3B): Qwen3-Next's hybrid MoE decoder (dtlaunch/models/qwen3_next/) with Qwen3.5's split Gated
DeltaNet input projections: every block sparse, top-k softmax weights renormalised, one shared expert
behind a sigmoid gate. The dense sibling and the shared Qwen3.5 parts are dtlaunch/models/qwen3_5/."""

from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.qwen3_5.hf import Qwen3_5MoeHF
from dtlaunch.models.qwen3_next.config import Qwen3NextModelConfig
from dtlaunch.models.qwen3_next.spec import hybrid_spec
from dtlaunch.models.registry import register

SPEC = register(
    hybrid_spec(
        moe_spec(
            "qwen3_5_moe",
            "Qwen3.5-MoE decoder (Gated DeltaNet and gated full attention, top-k softmax router, gated shared expert)",
            Qwen3_5MoeHF("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", qk_norm=True),
            "dtlaunch.models.qwen3_5_moe.names",
            ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
            qkv_bias=False,
            qk_norm=True,
            norm_offset=1.0,
            attention_output_gate=True,
            shared_expert_gate=True,
            # What Qwen3.5-MoE's config.json cannot say otherwise (it has no such keys).
            **{"moe.score_func": "softmax", "moe.norm_topk": True, "moe.sparse_step": 1, "moe.dense_layers": []},
        ),
        "dtlaunch.models.qwen3_5.model:build_moe_model",
        split_projections=True,
        config=Qwen3NextModelConfig,
        check="dtlaunch.models.qwen3_next.check:check",
    )
)
