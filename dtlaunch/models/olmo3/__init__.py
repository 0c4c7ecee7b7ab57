"""OLMo 3 (Olmo3ForCausalLM): the dense decoder with post-norm blocks, q/k RMSNorm over the whole
projection and sliding-window attention in three blocks of four (`model.layer_types`)."""

from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.olmo3.config import Olmo3ModelConfig
from dtlaunch.models.olmo3.hf import Olmo3HF
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "olmo3",
        "OLMo 3 decoder (post-norm, whole-projection q/k norm, sliding windows per layer)",
        Olmo3HF("Olmo3ForCausalLM", "olmo3", qk_norm=True, extra_config=(("attention_bias", False),)),
        ("Olmo3ForCausalLM",),
        config=Olmo3ModelConfig,
        check="dtlaunch.models.olmo3.check:check",
        hf_names="dtlaunch.models.olmo3.names",
        qkv_bias=False,
        qk_norm=True,
        qk_norm_whole=True,
        post_norm=True,
    )
)
