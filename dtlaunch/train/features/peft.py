"""Parameter-efficient fine-tuning on the meta model (`peft.method`): LoRA adapters on the target linears,
every other parameter frozen. Runs right after the model is built, before float8, tensor parallel,
pipeline splitting or FSDP, which then see the adapters as ordinary (trainable) parameters and the base
as frozen ones: DDP and FSDP reduce only the adapters' gradients, the optimizer holds only their state,
and checkpoints save only them (dtlaunch.train.checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from dtlaunch.models.lora import apply_lora
from dtlaunch.models.registry import model_spec

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def peft_enabled(cfg: JobConfig) -> bool:
    peft = getattr(cfg, "peft", None)
    return peft is not None and str(peft.method) != "none"


def apply_peft(model: nn.Module, cfg: JobConfig, modules_to_save: tuple[str, ...] = ()) -> list[str]:
    """Adapt and freeze `model` in place as cfg.peft says (`modules_to_save`: the objective's modules that
    train in full, a reward model's score head); returns the adapted linears' names."""
    if not peft_enabled(cfg):
        return []
    return apply_lora(model, model_spec(cfg.model), cfg.peft, modules_to_save)
