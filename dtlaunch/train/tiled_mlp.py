"""Tiled MLP (`training.mlp_tiles`, ALST's TiledMLP): each SwiGLU MLP runs over tiles of the sequence, in
forward and again in backward, so a block never holds its [tokens x FFN width] intermediates whole.

Forward runs every tile without autograd and keeps only the MLP's input; backward recomputes one tile at a
time with autograd, takes that tile's input gradient and its parameters' gradients, and sums the tiles'.
The MLP's trained parameters (full weights, or LoRA's adapters; QLoRA's frozen NF4 base has none) are the
function's inputs, so autograd accumulates each parameter's gradient once per backward, as without tiles:
DDP's reducer hooks fire once, and FSDP2's post-backward finds the summed gradient on the unsharded
parameter. Under tensor parallel a tile runs through the same TP hooks (its w2 output is reduced per
tile): tiles of the local shard. The RNG state of the forward is replayed for the recompute (LoRA's
dropout draws the same masks).

Applied from outside the model (dtlaunch.train.parallel.parallelize, before activation checkpointing):
every `FeedForward` of the blocks (dense blocks, and MoE blocks' shared experts; not the routed experts,
whose router statistics and aux loss need the whole micro-batch) runs tiled; the model code knows
nothing of it. Compiled blocks run the tiled MLP eagerly (a graph break): its backward runs
autograd itself, which dynamo does not trace.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dtlaunch.models.dense.model import FeedForward


def tiled_forward(mlp: nn.Module, tiles: int, x: torch.Tensor) -> torch.Tensor:
    """`mlp`'s own forward over `tiles` tiles of dim -2 (the sequence of (B, S, h), or the tokens of (N, h))."""
    run = partial(type(mlp).forward, mlp)
    if not torch.is_grad_enabled():  # evaluation, generation: no backward to recompute for
        return torch.cat([run(t) for t in _tiles(x, tiles)], dim=-2)
    params = [p for p in mlp.parameters() if p.requires_grad]
    return _TiledMLPFunction.apply(run, tiles, x, *params)


def _tiles(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return x.tensor_split(min(n, x.shape[-2]), dim=-2)


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Any, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tiles, ctx.params = run, tiles, params
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():  # detached: a no-grad view of x would require grad without a grad_fn
            return torch.cat([run(t) for t in _tiles(x.detach(), tiles)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        params = ctx.params
        grad_x = torch.empty_like(x)
        grad_params: list[Any] = [None] * len(params)
        start = 0
        with torch.random.fork_rng(devices=_cuda_devices(x.device)), torch.enable_grad():
            _set_rng_state(ctx.rng, x.device)
            for tile in _tiles(x, ctx.tiles):
                n = tile.shape[-2]
                inp = tile.detach().requires_grad_(x.requires_grad)
                out = ctx.run(inp)
                wrt = ([inp] if x.requires_grad else []) + list(params)
                grads = torch.autograd.grad(out, wrt, grad_out.narrow(-2, start, n), allow_unused=True)
                if x.requires_grad:
                    grad_x.narrow(-2, start, n).copy_(grads[0])
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
                del out, grads
                start += n
        return (None, None, grad_x if x.requires_grad else None, *grad_params)


def _cuda_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def apply_tiled_mlp(model: nn.Module, tiles: int) -> int:
    """Every FeedForward under `model.layers` runs tiled (1: untouched): its forward is replaced on the
    instance, so parameter names, TP plans and LoRA targets stay those of the model. Returns how many."""
    if tiles <= 1:
        return 0
    # Compiled blocks run it eagerly (see above). Wrapped here, not decorated at import: the decorator
    # imports torch._dynamo, about a second of every worker's start whether it tiles or not.
    eager = torch.compiler.disable(tiled_forward)
    wrapped = 0
    for block in model.layers.values():
        for mod in list(block.modules()):
            if isinstance(mod, FeedForward):
                mod.forward = partial(eager, mod, tiles)
                wrapped += 1
    return wrapped
