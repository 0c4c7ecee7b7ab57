"""gpt-oss (GptOssForCausalLM, gpt-oss-20b / 120b): the MoE decoder with attention sinks, biased q/k/v/o
projections, alternating sliding-window / full blocks, YaRN RoPE, a biased top-k softmax router and biased
experts with a clamped SwiGLU (model fields: dtlaunch/models/gpt_oss/config.py)."""

import dataclasses

from dtlaunch.models.gpt_oss.config import GptOssModelConfig
from dtlaunch.models.gpt_oss.hf import GptOssHF
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(
    dataclasses.replace(
        moe_spec(
            "gpt_oss",
            "gpt-oss decoder (attention sinks, alternating sliding / full layers, YaRN, biased top-k router and experts)",
            GptOssHF("GptOssForCausalLM", "gpt_oss", qkv_bias=None, experts_key="num_local_experts"),
            "dtlaunch.models.gpt_oss.names",
            ("GptOssForCausalLM",),
            qk_norm=False,
            attention_sinks=True,
            **{
                "moe.num_shared_experts": 0,
                "moe.score_func": "softmax",
                "moe.norm_topk": True,
                "moe.expert_dim": None,
                "moe.sparse_step": 1,
                "moe.dense_layers": [],
            },
        ),
        config=GptOssModelConfig,
        check="dtlaunch.models.gpt_oss.check:check",
        # The sinks' attention is the decoder's own eager one (sink_attention): context parallel cannot swap it.
        ring_attention=False,
    )
)
