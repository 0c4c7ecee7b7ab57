"""The tiled MLP's terms (`training.mlp_tiles`, dtlaunch.train.tiled_mlp) in a dense block's plan.

Tiled, a block's SwiGLU keeps nothing of its own between forward and backward: its input (the ffn norm's
output) is what the untiled w1 / w3 save already (counted with the norm). So the MLP's saved
intermediates (w1, SiLU, w3 and their product: 4·e·F per token; 3·e·F compiled, where Inductor drops
the SiLU output) leave every kind that kept them. In the block's backward, one tile's recompute is live
at a time: its four F-wide intermediates and the two F-wide gradients, over 1/tiles of the tokens,
instead of the whole sequence's two F-wide gradients; the MLP's input gradient is written tile by tile
into a buffer of the input's size (e·h). The tiles' parameter gradients are summed before autograd
accumulates them once: one extra copy of the trained MLP weights' gradients while the block's backward
runs (full training; the adapters' are negligible).

The MoE family's shared experts are tiled too but not counted here (the plan over-counts them).
"""

from __future__ import annotations

from typing import Any


def tiled(act: Any, tiles: int) -> bool:
    """Whether the tiles change this family's plan (the dense blocks; see the module doc for MoE)."""
    return tiles > 1 and not hasattr(act.BlockDims, "sparse")


def mlp_saved_bytes(d: Any, e: int, tp: int, compiled: bool) -> float:
    """Per token: what an untiled SwiGLU saves for backward, which its tiled form does not."""
    return (3 if compiled else 4) * e * d.f / tp


def tile_working_bytes(d: Any, e: int, tp: int, tiles: int) -> float:
    """Per token of the micro-batch, the change to one block's backward gradients: one tile's recompute and
    gradients (6·e·F over `tiles`) and the input-gradient buffer (e·h), less the untiled F-wide
    gradients (2·e·F)."""
    return 6 * e * d.f / (tp * tiles) + e * d.h - 2 * e * d.f / tp


def grad_sum_bytes(d: Any, grad_bytes: int, tp: int, full_training: bool) -> float:
    """Per block: the tiles' summed gradients of the trained MLP weights, beside autograd's own."""
    return grad_bytes * 3 * d.h * d.f / tp if full_training else 0.0
