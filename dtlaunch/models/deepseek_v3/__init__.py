"""DeepSeek-V3 (DeepseekV3ForCausalLM): the MoE decoder with multi-head latent attention (low-rank queries,
a compressed key/value latent and one shared rotated key), a sigmoid router with a correction bias and
group-limited top-k, routed scaling, shared experts, dense first blocks, and YaRN RoPE scaling."""

import dataclasses

import dtlaunch.models.deepseek_v3.flops as flops
import dtlaunch.models.deepseek_v3.shapes as shapes
from dtlaunch.models.deepseek_v3.config import DeepseekV3ModelConfig
from dtlaunch.models.deepseek_v3.hf import DeepseekV3HF
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(
    dataclasses.replace(
        moe_spec(
            "deepseek_v3",
            "DeepSeek-V3 decoder (multi-head latent attention, sigmoid router with correction bias and groups, "
            "shared experts)",
            DeepseekV3HF("DeepseekV3ForCausalLM", "deepseek_v3", qkv_bias=None),
            "dtlaunch.models.deepseek_v3.names",
            ("DeepseekV3ForCausalLM",),
            **{"moe.score_func": "sigmoid_bias", "moe.sparse_step": 1},
        ),
        builder="dtlaunch.models.deepseek_v3.model:build_model",
        tp_plan="dtlaunch.models.deepseek_v3.tp_plan",
        param_count=shapes.param_count,
        block_params=shapes.block_params,
        block_norm_params=shapes.block_norm_params,
        flops_per_token=flops.flops_per_token,
        matmul_params=flops.matmul_params,
        tp_divisors=shapes.tp_divisors,
        tp_whole_block_params=shapes.whole_under_tp,
        block_linears=shapes.block_linears,
        lora_default_extra=("q_b_proj", "kv_b_proj"),
        kv_cache_values=shapes.kv_cache_values,
        decode_derived_values=shapes.decode_derived_values,
        activations="dtlaunch.models.deepseek_v3.activations",
        ring_attention=False,
        config=DeepseekV3ModelConfig,
        check="dtlaunch.models.deepseek_v3.check:check",
        check_layout="dtlaunch.models.deepseek_v3.check:check_layout",
    )
)
