"""Mistral 7B: the dense decoder with sliding-window attention when config.json sets a window."""

from dtlaunch.models.dense.hf import DenseHF
from dtlaunch.models.dense.spec import dense_spec
from dtlaunch.models.registry import register

SPEC = register(
    dense_spec(
        "mistral",
        "Mistral decoder (GQA, optional sliding-window attention)",
        DenseHF("MistralForCausalLM", "mistral", sliding=True, uniform_window=True),
        ("MistralForCausalLM",),
        qkv_bias=False,
        qk_norm=False,
    )
)
