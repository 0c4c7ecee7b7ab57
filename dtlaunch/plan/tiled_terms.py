"""The tiled MLP's terms (`training.mlp_tiles`, dtlaunch.train.features.tiled_mlp) in a block's plan.

Tiled, a block's SwiGLU keeps nothing of its own between forward and backward: its input (the ffn norm's
output) is what the untiled w1 / w3 save already (counted with the norm). So the MLP's saved
intermediates (w1, SiLU, w3 and their product: 4·e·F per token; 3·e·F compiled, where Inductor drops
the SiLU output) leave every kind that kept them. In the block's backward, one tile's recompute is live
at a time: its four F-wide intermediates and the two F-wide gradients, over 1/tiles of the tokens,
instead of the whole sequence's two F-wide gradients; the MLP's input gradient is written tile by tile
into a buffer of the input's size (e·h). The tiles' parameter gradients are summed before autograd
accumulates them once: one extra copy of the trained MLP weights' gradients while the block's backward
runs (full training; the adapters' are negligible).

Each family's activation model has the formulas (`tiled_saved_bytes`, `tiled_working_bytes`,
`tiled_grad_sum_elements`: dtlaunch/models/dense/activations.py, dtlaunch/models/moe/activations.py).
The MoE family: the routed experts run over tiles of their routed copies (the router and dispatch stay
whole), so their F-wide intermediates leave the saved set and one tile of the copies is recomputed at a
time; the shared experts and dense blocks count as the dense SwiGLU.
"""

from __future__ import annotations

from typing import Any


def tiled(act: Any, tiles: int) -> bool:
    """Whether the tiles change the plan: every registry family tiles its MLPs (dense and MoE)."""
    return tiles > 1


def mlp_saved_bytes(act: Any, d: Any, e: int, tp: int, compiled: bool) -> float:
    """Per token: what the family's untiled MLPs save for backward, which their tiled forms do not."""
    return act.tiled_saved_bytes(d, e, tp, compiled)


def tile_working_bytes(act: Any, d: Any, e: int, tp: int, tiles: int) -> float:
    """Per token of the micro-batch, the change to one block's backward working set."""
    return act.tiled_working_bytes(d, e, tp, tiles)


def grad_sum_bytes(act: Any, d: Any, grad_bytes: int, tp: int, full_training: bool) -> float:
    """Per block: the tiles' summed gradients of the trained MLP weights, beside autograd's own."""
    return grad_bytes * act.tiled_grad_sum_elements(d, tp) if full_training else 0.0
