"""One mixture-of-experts FFN: a token-choice top-k router, the routed experts, optional shared experts.

Forward: router scores -> top-k experts per token -> the token copies grouped by expert with a stable
sort -> `self.experts(x_grouped, num_tokens_per_expert)` -> copies back in token order, weighted by
their scores and summed -> plus the shared experts. Nothing is dropped: every expert takes every token
routed to it. Expert parallelism wraps only `experts` (the one call above is its whole interface).

Load balancing, two ways (both optional):
- the auxiliary loss (Switch / Qwen-MoE form, E * sum_e f_e * P_e with f_e the share of tokens routed
  to expert e and P_e its mean router probability) is added without changing what the model returns:
  `_AddAuxGrad` passes the layer output through and feeds the loss's gradient into backward, so
  pipeline stages and the loss code stay as they are;
- DeepSeek-V3's auxiliary-loss-free balancing adds a per-expert bias (`router.expert_bias`, a buffer
  saved with the checkpoint) to the scores used to *choose* experts, never to weight them; the
  training loop nudges it after each step from the token counts (dtlaunch.models.moe.balance).

`tokens_per_expert` counts this process's routed token copies per expert since the training loop last
reset it (before any expert-parallel dispatch); `aux_loss_stats` holds (sum of aux values, count).
Activation checkpointing replays forward during backward: the replay does not count again.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dtlaunch.models.dense.model import FeedForward
from dtlaunch.models.moe.experts import GroupedExperts


class Router(nn.Module):
    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str,
        norm_topk: bool,
        bias: bool,
        n_group: int = 1,
        topk_group: int = 1,
        scale: float = 1.0,
        gate_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk = score_func, norm_topk
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        # gate_bias: a learned bias on the router logits (gpt-oss), part of the scores (unlike expert_bias).
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        # Only with the bias update or a checkpoint's correction bias (score_func=sigmoid_bias): a model
        # without either has no such tensor (as in the HF checkpoints of the other families).
        self.expert_bias: Optional[torch.Tensor]
        if bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (top-k weights [T, k], top-k expert ids [T, k], scores [T, E] in fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            choose = self._best_groups(choose)
        _, ids = torch.topk(choose, self.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights, ids, scores

    def _best_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """`choose` with every expert outside the token's topk_group best groups at -inf (a group's
        score: the sum of its two best choice scores, as DeepSeek-V3 and transformers' GLM-4.5 rank them)."""
        groups = choose.view(choose.shape[0], self.n_group, -1)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choose)


class _AddAuxGrad(torch.autograd.Function):
    """Identity on the layer output; backward also sends `scale` * d(aux)/d(router) into the graph."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        num_shared: int = 0,
        shared_hidden: int = 0,
        score_func: str = "softmax",
        norm_topk: bool = True,
        aux_loss_coef: float = 0.0,
        expert_bias: bool = False,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling: float = 1.0,
        gate_bias: bool = False,
        expert_linear_bias: bool = False,
        swiglu_clamp: Optional[tuple[float, float]] = None,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(
            dim, num_experts, top_k, score_func, norm_topk, expert_bias, n_group, topk_group, routed_scaling, gate_bias
        )
        self.experts = GroupedExperts(num_experts, dim, hidden, bias=expert_linear_bias, swiglu_clamp=swiglu_clamp)
        self.shared_experts: Optional[FeedForward] = (
            FeedForward(dim, shared_hidden or num_shared * hidden) if num_shared else None
        )
        # Qwen3-Next: the shared experts' output times sigmoid(one learned logit per token).
        self.shared_gate: Optional[nn.Linear] = nn.Linear(dim, 1, bias=False) if shared_gate and num_shared else None
        # The aux loss's weight in the total loss (already divided by the number of MoE layers), and
        # the factor the training loop sets to match its loss scaling (1 / gradient-accumulation steps).
        self.aux_loss_coef = float(aux_loss_coef)
        self.aux_grad_scale = 1.0
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("aux_loss_stats", torch.zeros(2, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids, scores = self.router(x)
        flat = ids.reshape(-1)
        # Copies of each token, grouped by expert; the stable sort keeps token order within an expert.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        routed = self.experts(x[order // self.top_k], counts)
        # Back to (token, slot) order (a permutation: no accumulation), weighted, summed over the k slots.
        unsorted = torch.empty_like(routed)
        unsorted[order] = routed
        out = (unsorted.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        # Training forwards only (not evaluation, which runs without grad). Activation checkpointing's
        # replay computes the aux loss again (backward reads what it saved) but does not count again.
        training = self.training and torch.is_grad_enabled()
        aux = self._aux_loss(scores, counts) if self.aux_loss_coef > 0 and training else None
        if training and not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
                if aux is not None:
                    self.aux_loss_stats += torch.stack([aux.detach(), torch.ones_like(aux)])
        if aux is not None:
            out = _AddAuxGrad.apply(out, aux, self.aux_loss_coef * self.aux_grad_scale)
        return out.reshape(shape)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """E * sum_e f_e * P_e: f_e = routed copies / tokens (top-k sums to k), P_e = mean probability
        (sigmoid scores normalised per token). Equals k when tokens and probabilities are uniform."""
        probs = scores if self.router.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        tokens = scores.shape[0]
        return self.num_experts * (counts.float() / tokens * probs.mean(0)).sum()


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing replaying this forward)."""
    return torch._C._current_graph_task_id() != -1
