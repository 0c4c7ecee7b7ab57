"""Autocast's compute-dtype weight copies (one process or DDP with precision.param_dtype below fp32): what
the plan's "autocast weight copies" line holds (dtlaunch.plan.stage.static_lines) and which of them backward
frees on its way (dtlaunch.plan.backward). One owner, so the line and the moments that take from it agree.

Backward runs outside autocast (dtlaunch.train.step), whose cast cache is gone by then: a copy's only
reference is the matmul that saved it, and it is freed by that matmul's backward.
"""

from __future__ import annotations

from dtlaunch.plan.loss_terms import loss_chunks
from dtlaunch.plan.shape import StageShape


def weight_copies(c: StageShape) -> float | None:
    """The line (None: no autocast). A chunked loss casts the head per chunk instead (dtlaunch.plan.loss_terms).
    torchao's Float8Linear saves its input and the parameter itself (it casts to float8 inside): only the
    head, still a plain linear, keeps a copy then."""
    copies = _saved_copies(c)
    if copies is None:
        return None
    if loss_chunks(c) > 1 and _head_counted(c):
        copies -= c.compute_bytes * c.vocab_params
    if c.cfg.precision.float8 != "none":
        copies = min(copies, c.compute_bytes * c.vocab_params if c.last_stage else 0.0)
    return copies


def head_cast(c: StageShape) -> float:
    """The output head's copy where the line holds it (one full-vocabulary pass), freed by the head's
    backward inside the loss's."""
    return c.compute_bytes * c.vocab_params if _head_counted(c) and loss_chunks(c) == 1 else 0.0


def block_cast(c: StageShape) -> float:
    """One block's copies where the line holds every block's (no AC, eager, full training), freed by the
    block's backward; 0 elsewhere."""
    every_block = c.blocks_without_ac == c.layers and not c.compiled and not c.peft
    if not c.autocast or not every_block or c.cfg.precision.float8 != "none":
        return 0.0
    return c.compute_bytes * (c.block_params - c.block_norm_params)


def _head_counted(c: StageShape) -> bool:
    """Whether the saved copies include the head's: a trained head, or with LoRA a tied one (the frozen
    head is stored in the compute dtype, its own cast)."""
    return c.autocast and c.last_stage and (not c.peft or c.tied_head)


def _saved_copies(c: StageShape) -> float | None:
    """Compute-dtype copies of the weights that autocast's matmuls save for backward, the head's included
    (None: no line)."""
    e, layers, kept = c.compute_bytes, c.layers, c.blocks_without_ac
    if not c.autocast:
        return None
    if c.peft:
        # Frozen linears are stored in the compute dtype (their cast is the weight itself), QLoRA's NF4
        # matmuls save the NF4 weight: only the adapters' casts (and a tied head's) are copies.
        # bf16 adapters (optim.state_dtype=bf16) are their own cast.
        adapters = c.peft.adapters if kept == layers and not c.compiled and c.grad_element_bytes == 4 else 0
        return e * (adapters + (c.vocab_params if c.tied_head and c.last_stage else 0))
    if kept and c.compiled:
        # Compiled blocks recompute their weights' casts in backward instead of saving them.
        return e * c.vocab_params if c.last_stage else 0.0
    if kept == layers:
        # Each weight's compute-dtype copy (not the embedding's, nor norm gains) is saved by its matmul
        # from forward to backward; under AC the casts are recomputed with the block instead.
        # A tied matrix is also the head, a matmul weight: its cast is saved as well.
        head_cast = c.vocab_params if c.tied_head and c.last_stage else 0
        return e * (c.rank_params - (c.vocab_params if c.first_stage else 0) - c.block_norm_params * layers + head_cast)
    if kept:  # layer policy: the blocks it does not checkpoint keep their copies
        return e * (kept * (c.block_params - c.block_norm_params) + (c.vocab_params if c.last_stage else 0))
    if c.last_stage:
        return e * c.vocab_params
    return None
