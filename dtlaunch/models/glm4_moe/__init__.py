"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM): the MoE decoder with q/k/v biases, optional per-head q/k
norm, partial RoPE, a sigmoid router with a correction bias and group-limited top-k, shared experts, and
dense first blocks (first_k_dense_replace)."""

import dataclasses

from dtlaunch.models.glm4_moe.config import Glm4MoeModelConfig
from dtlaunch.models.glm4_moe.hf import Glm4MoeHF
from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(
    dataclasses.replace(
        moe_spec(
            "glm4_moe",
            "GLM-4.5 decoder (partial RoPE, sigmoid router with correction bias and groups, shared experts)",
            Glm4MoeHF("Glm4MoeForCausalLM", "glm4_moe", qkv_bias=None),
            "dtlaunch.models.glm4_moe.names",
            ("Glm4MoeForCausalLM",),
            **{"moe.score_func": "sigmoid_bias", "moe.sparse_step": 1},
        ),
        config=Glm4MoeModelConfig,
        check="dtlaunch.models.glm4_moe.check:check",
    )
)
