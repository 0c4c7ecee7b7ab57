"""Expert load balancing and router statistics, driven by the training loop (model code never reduces).

Each MoE layer counts the token copies it routed per expert (`tokens_per_expert`, this process's tokens,
global expert index) and sums its aux-loss values (`aux_loss_stats`) over a step's micro-batches. After
the step the loop:
- `update_expert_bias(model, reduce_sum, rate)`: DeepSeek-V3's auxiliary-loss-free balancing; with the
  counts summed over the data-parallel ranks (`reduce_sum`, an all-reduce the loop provides), every
  expert's routing bias moves by `rate` towards balance (up when under-loaded), centred so the biases
  keep a zero mean; the same on every rank, since the reduced counts are;
- `step_stats(parts, n_layers)`: this rank's counts and aux sums as one flat device tensor, laid out by
  global layer index (pipeline stages fill only their rows), which the loop's once-per-window
  all-reduce sums over ranks: no collective and no host sync of its own;
- `reset(parts)`: zero the counters for the next step.
`summarize(values, ...)` turns a window's summed vector into the logged numbers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from dtlaunch.models.moe.layer import MoE


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{global block index: its MoE layer} (wrappers such as FSDP, DDP or AC keep the block names)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MoE):
            parts = name.split(".")
            out[int(parts[parts.index("layers") + 1])] = mod
    return out


def set_aux_grad_scale(parts: Iterable[nn.Module], scale: float) -> None:
    """The aux loss's gradient scaled like the main loss (1 / micro-batches summed into one step)."""
    for part in parts:
        for layer in moe_layers(part).values():
            layer.aux_grad_scale = float(scale)


@torch.no_grad()
def update_expert_bias(model: nn.Module, reduce_sum: Callable[[torch.Tensor], torch.Tensor], rate: float) -> None:
    layers = [m for _, m in sorted(moe_layers(model).items()) if m.router.expert_bias is not None]
    if not layers or rate <= 0:
        return
    counts = reduce_sum(torch.stack([m.tokens_per_expert for m in layers]))
    delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
    delta -= delta.mean(-1, keepdim=True)
    for m, d in zip(layers, delta, strict=True):
        m.router.expert_bias.add_(d)


def step_stats(parts: Iterable[nn.Module], n_layers: int, num_experts: int) -> Optional[torch.Tensor]:
    """[n_layers x num_experts token counts..., aux sum, aux count] of this rank (None: no MoE layer)."""
    layers = {i: m for part in parts for i, m in moe_layers(part).items()}
    if not layers:
        return None
    any_layer = next(iter(layers.values()))
    counts = torch.zeros(n_layers, num_experts, device=any_layer.tokens_per_expert.device)
    for i, m in layers.items():
        counts[i] = m.tokens_per_expert
    aux = torch.stack([m.aux_loss_stats for m in layers.values()]).sum(0)
    return torch.cat([counts.flatten(), aux])


@torch.no_grad()
def reset(parts: Iterable[nn.Module]) -> None:
    for part in parts:
        for m in moe_layers(part).values():
            m.tokens_per_expert.zero_()
            m.aux_loss_stats.zero_()


def summarize(values: list[float], sparse: list[int], num_experts: int, replicas: int) -> dict[str, Any]:
    """Logged numbers from a step's vector summed over all ranks: `replicas` ranks (tensor parallel)
    count the same tokens. Imbalance = max / mean tokens per expert (1 = balanced), per sparse layer."""
    n = len(values) - 2
    rows = [values[i * num_experts : (i + 1) * num_experts] for i in range(n // num_experts)]
    rows = [[c / replicas for c in rows[i]] for i in sparse]
    ratios = [max(r) / (sum(r) / len(r)) for r in rows if sum(r) > 0]
    out: dict[str, Any] = {
        "moe_tokens_per_expert": [round(sum(col), 3) for col in zip(*rows, strict=True)],
    }
    if ratios:
        out["moe_imbalance"] = sum(ratios) / len(ratios)
        out["moe_imbalance_max"] = max(ratios)
    if values[-1] > 0:
        out["moe_aux_loss"] = values[-2] / values[-1]
    return out


def router_stats(model: nn.Module, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """The logged numbers for `model`'s counters now, reduced with `reduce_sum` (tests, one-off reads)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    n_layers, e = max(layers) + 1, next(iter(layers.values())).num_experts
    vec = step_stats([model], n_layers, e)
    return summarize(reduce_sum(vec).tolist(), sorted(layers), e, 1)
