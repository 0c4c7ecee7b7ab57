"""Tiled MLP (`training.mlp_tiles`, ALST's TiledMLP): each SwiGLU MLP runs over tiles of its rows, in forward
and again in backward, so a block never holds its [tokens x FFN width] intermediates whole.

Forward runs every tile without autograd and keeps only the MLP's input; backward recomputes one tile at a
time with autograd, takes that tile's input gradient and its parameters' gradients, and sums the tiles'.
The MLP's trained parameters (full weights, or LoRA's adapters; QLoRA's frozen NF4 base has none) are the
function's inputs, so autograd accumulates each parameter's gradient once per backward, as without tiles:
DDP's reducer hooks fire once, and FSDP2's post-backward finds the summed gradient on the unsharded
parameter. Under tensor parallel a tile runs through the same TP hooks (its w2 output is reduced per
tile): tiles of the local shard. The forward's RNG state (LoRA's dropout draws the same masks) and
autocast state (backward runs outside the autocast region) are replayed for the recompute.

Applied from outside the model (dtlaunch.train.parallel.parallelize, after expert parallel, before
activation checkpointing); the model code knows nothing of it:
- every `FeedForward` of the blocks (dense blocks, MoE blocks' shared experts) runs over tiles of the
  sequence;
- every MoE block's routed experts (`GroupedExperts`) run over tiles of their permuted rows, the token
  copies already grouped by expert (after any expert-parallel dispatch). The router, top-k, dispatch
  and aux loss stay whole: their statistics need the whole micro-batch. A tile's per-expert counts are
  the experts' row ranges intersected with the tile's, so a tile may hold no row of some or all experts
  (that tile's gradient of theirs is zero, not None: experts.py `_looped`). Every expert row is computed
  on its own, so the tiles give the untiled numbers within an ulp (a matmul's rounding follows the rows
  it is given; tests/unit/test_tiled_experts.py).
Compiled blocks run the tiled MLP eagerly (a graph break): its backward runs autograd itself, which
dynamo does not trace.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from dtlaunch.models.dense.model import FeedForward
from dtlaunch.models.moe.experts import GroupedExperts

# run(tile, start, stop): the module's forward on rows [start, stop) of its input (dim -2).
TileRun = Callable[[torch.Tensor, int, int], torch.Tensor]


def tiled_forward(mlp: nn.Module, tiles: int, x: torch.Tensor) -> torch.Tensor:
    """`mlp`'s own forward over `tiles` tiles of dim -2 (the sequence of (B, S, h), or the tokens of (N, h))."""
    forward = partial(type(mlp).forward, mlp)
    return _run_tiled(mlp, lambda t, start, stop: forward(t), tiles, x)


def tiled_experts_forward(
    experts: nn.Module, tiles: int, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """`GroupedExperts`' own forward over `tiles` tiles of its rows (x: [T, dim] grouped by expert). A tile's
    count of expert e is the overlap of [start, stop) with e's rows [offset_e, offset_e + count_e): tensor
    ops, so the grouped kernel still reads no count on the host."""
    ends = torch.cumsum(num_tokens_per_expert, 0)
    begins = ends - num_tokens_per_expert
    forward = partial(type(experts).forward, experts)

    def run(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return forward(t, ends.clamp(start, stop) - begins.clamp(start, stop))

    return _run_tiled(experts, run, tiles, x)


def _run_tiled(mod: nn.Module, run: TileRun, tiles: int, x: torch.Tensor) -> torch.Tensor:
    bounds = _bounds(x.shape[-2], tiles)
    if not torch.is_grad_enabled():  # evaluation, generation: no backward to recompute for
        return torch.cat([run(x.narrow(-2, a, b - a), a, b) for a, b in bounds], dim=-2)
    params = [p for p in mod.parameters() if p.requires_grad]
    return _TiledMLPFunction.apply(run, bounds, x, *params)


def _bounds(rows: int, tiles: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of `tiles` near-equal tiles (tensor_split's sizes: the first rows % n one row longer);
    one empty tile when there is no row (an expert-parallel rank that received no token)."""
    n = max(1, min(tiles, rows))
    size, extra = divmod(rows, n)
    stops = [(i + 1) * size + min(i + 1, extra) for i in range(n)]
    return tuple(zip([0, *stops[:-1]], stops, strict=True))


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: TileRun, bounds: tuple, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.bounds, ctx.params = run, bounds, params
        ctx.rng = _rng_state(x.device)
        ctx.autocast = _autocast_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():  # detached: a no-grad view of x would require grad without a grad_fn
            x = x.detach()
            return torch.cat([run(x.narrow(-2, a, b - a), a, b) for a, b in bounds], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        params = ctx.params
        grad_x = torch.empty_like(x)
        grad_params: list[Any] = [None] * len(params)
        with torch.random.fork_rng(devices=_cuda_devices(x.device)), torch.enable_grad(), _autocast(ctx.autocast, x):
            _set_rng_state(ctx.rng, x.device)
            for start, stop in ctx.bounds:
                n = stop - start
                inp = x.narrow(-2, start, n).detach().requires_grad_(x.requires_grad)
                out = ctx.run(inp, start, stop)
                wrt = ([inp] if x.requires_grad else []) + list(params)
                grads = torch.autograd.grad(out, wrt, grad_out.narrow(-2, start, n), allow_unused=True)
                if x.requires_grad:
                    if grads[0] is not None:  # None: the tile has no row (an EP rank that received none)
                        grad_x.narrow(-2, start, n).copy_(grads[0])
                    grads = grads[1:]
                _accumulate(grad_params, grads)
                del out, grads  # before the next tile's recompute
        return (None, None, grad_x if x.requires_grad else None, *grad_params)


def _accumulate(sums: list, grads: tuple) -> None:
    """The tiles' parameter gradients summed into `sums` (in a function: no loop variable keeps the last
    tile's gradient alive through the next tile's recompute: measured, one weight's gradient more at the
    peak of a tiled MoE block's backward)."""
    for i, g in enumerate(grads):
        if g is not None:
            sums[i] = g if sums[i] is None else sums[i].add_(g)


def _cuda_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _autocast_state(device: torch.device) -> Optional[tuple[bool, torch.dtype]]:
    if not torch.amp.is_autocast_available(device.type):  # meta tensors (the planner's traces)
        return None
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _autocast(state: Optional[tuple[bool, torch.dtype]], x: torch.Tensor) -> Any:
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, dtype=state[1], enabled=state[0])


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def apply_tiled_mlp(model: nn.Module, tiles: int) -> int:
    """Every FeedForward and GroupedExperts under `model.layers` runs tiled (1: untouched): its forward is
    replaced on the instance, so parameter names, TP / EP plans (their hooks wrap the call, not the
    forward) and LoRA targets stay those of the model. Returns how many."""
    if tiles <= 1:
        return 0
    # Compiled blocks run it eagerly (see above). Wrapped here, not decorated at import: the decorator
    # imports torch._dynamo, about a second of every worker's start whether it tiles or not.
    eager = {FeedForward: torch.compiler.disable(tiled_forward)}
    eager[GroupedExperts] = torch.compiler.disable(tiled_experts_forward)
    wrapped = 0
    for block in model.layers.values():
        for mod in list(block.modules()):
            kind = next((k for k in eager if isinstance(mod, k)), None)
            if kind is not None:
                mod.forward = partial(eager[kind], mod, tiles)
                wrapped += 1
    return wrapped
