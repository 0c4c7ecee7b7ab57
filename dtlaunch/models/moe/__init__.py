"""`model.arch=moe`: the MoE decoder with every routing option (sigmoid scores, shared experts, the
expert bias), for models trained from scratch; no Hugging Face format (qwen3_moe and mixtral have one)."""

from dtlaunch.models.moe.spec import moe_spec
from dtlaunch.models.registry import register

SPEC = register(moe_spec("moe", "Mixture-of-experts decoder (Llama attention, routed + shared experts)", None, "", ()))
