"""The weights of a dtlaunch run's checkpoint, read like a Hugging Face directory's (`read(name, shape,
offset)`, dtlaunch.convert.hf.HFWeights): DPO's objective.reference=RUN_DIR.

The checkpoint is read as `dtlaunch ckpt export` reads it (one process, no process group, any layout that
wrote it): a full run's parameters, or a LoRA / QLoRA run's base with its adapters merged (QLoRA's from
the NF4-rounded base it trained on). So the reference is exactly what `ckpt export RUN --format hf` writes.
Every rank reads the whole model once into host memory, then keeps only its own block of each parameter.
"""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.errors import InputError


class StateWeights:
    """Full tensors in our parameter names, handed out block by block."""

    def __init__(self, state: dict, where: str) -> None:
        self.state, self.where = state, where

    def read(self, name: str, shape: Optional[tuple] = None, offset: Optional[tuple] = None) -> Any:
        full = self.state.get(name)
        if full is None:
            raise InputError(f"{self.where}: the checkpoint holds no {name}: give a run of the model trained here")
        if shape is None:
            return full.float()
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))].float()


def run_weights(ref: str, m: Any) -> StateWeights:
    """objective.reference=RUN_DIR's weights, its checks run again here (the run may have changed since
    the launch)."""
    from dtlaunch.config.reference_run import reference_checkpoint
    from dtlaunch.convert.adapters import merged_run_state
    from dtlaunch.convert.hf import load_checkpoint_model
    from dtlaunch.run.phases import phase

    info = reference_checkpoint(ref, m)
    load = merged_run_state if info.marker.get("peft") else load_checkpoint_model
    state, _, info = load(info.path)
    phase(f"objective.reference: {len(state)} tensors from {info.path}")
    return StateWeights(state, f"objective.reference='{ref}' ({info.path})")
