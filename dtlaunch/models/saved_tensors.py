"""Which model tensors a checkpoint holds, by model name: one definition for the worker's checkpoint
writer (dtlaunch.train.checkpoint.states.ModelState) and the launcher's resume check
(dtlaunch.launch.preflight), which builds the same model on the meta device. Two definitions had drifted
apart once: the check listed a tied head once, the writer saved it under both names, and no tied run
could resume."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

# Prefixes added by wrappers (DDP, activation checkpointing, torch.compile, FSDP1) that the model's own
# parameter names do not have.
_WRAPPER_PARTS = re.compile(r"(^|\.)(module|_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")


def model_param_name(name: str) -> str:
    """'layers.0._checkpoint_wrapped_module.attention.wq.weight' -> 'layers.0.attention.wq.weight'."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


def saved_model_tensors(part: Any, trainable_only: bool) -> dict[str, Any]:
    """The model tensors a checkpoint holds for one model part, by model name (wrapper prefixes removed).

    The part's state_dict entries: every parameter under each of its names (a tied head is one Parameter
    as `tok_embeddings.weight` and `output.weight`, which named_parameters() lists once) and the
    persistent buffers (an MoE router's expert bias); with `trainable_only` (peft) less the frozen
    parameters under all their names (the frozen base is re-read from model.init_from, never saved)."""
    return {
        model_param_name(name): t
        for name, t in part.state_dict(keep_vars=True).items()
        if not (trainable_only and isinstance(t, nn.Parameter) and not t.requires_grad)
    }
