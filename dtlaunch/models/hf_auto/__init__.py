"""`model.arch=hf_auto model.init_from=hf:DIR`: any causal LM transformers can build, for the
architectures the registry has no native entry for (Phi-3, Gemma 2, GPT-NeoX, ...).

transformers' own AutoModelForCausalLM is wrapped to follow the runtime's protocol (its decoder layers
become the `layers` the runtime wraps with FSDP2, activation checkpointing and compile). No closed-form
memory model: the planner traces one step. Tensor parallel follows the architecture's own
`base_model_tp_plan` (tp_plan.py; validate refuses tp > 1 where there is none); no pipeline split
(validate asks for strategy.pp=1). Context parallel runs as Ulysses (strategy.cp_style=ulysses: the
attention installed through transformers' attention-function registry). Needs `pip install dtlaunch[hf]`.
"""

from __future__ import annotations

from dtlaunch.models.registry import register, traced_spec

SPEC = register(
    traced_spec(
        "hf_auto",
        "transformers' AutoModelForCausalLM for architectures without a native entry",
        "dtlaunch.models.hf_auto.build:build_model",
        tp_plan="dtlaunch.models.hf_auto.tp_plan",
        check="dtlaunch.models.hf_auto.check:check",
        hf_attention=True,
    )
)
