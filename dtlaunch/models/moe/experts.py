"""The routed experts of one MoE layer: SwiGLU FFNs stacked on a leading expert dimension.

Parameters are 3-D with the expert index first (`w1`, `w3`: [experts, hidden, dim], gate and up;
`w2`: [experts, dim, hidden], down), so expert parallelism shards them with Shard(0) and a rank's
module simply holds fewer experts. `forward(x, num_tokens_per_expert)` takes the token copies already
grouped by expert in expert order (what `MoE` and an expert-parallel dispatch hand it) and returns
their outputs in the same order. Every expert's rows are computed on their own, so any split of the
experts into contiguous groups gives the same numbers as the whole (bit for bit with the loop, within
an ulp with the grouped kernel, whose blocking follows the group sizes).

Kernels: `torch._grouped_mm` (one call for all experts, no host sync) where torch runs it: CUDA sm90+
in bf16, and CPU where this torch has the kernel (a probe, not a version check), with 16-byte aligned
rows. On CPU it gives the loop's numbers bit for bit, forward and backward, and is not slower
(bench/moe_experts_kernel.py). Elsewhere an exact loop of matmuls over the experts, which reads the
counts on the host. Under autocast the operands are cast to the autocast dtype first (torch has no
autocast rule for the grouped op), so both kernels compute in the same dtype.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# The dispatch hooks hand this module local tokens, so its weights must be local too.
from dtlaunch.models.local_tensor import local_tensor


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, cast: bool = False) -> bool:
    """Whether torch's grouped GEMM takes these operands computed in `dtype`: every row a multiple of 16
    bytes (torch refuses other strides), and CUDA Hopper or newer in bf16, or a CPU kernel for `dtype`.
    Traced (fake tensors, torch.compile), torch's shape function takes bf16 only. `cast`: both operands
    are cast to `dtype` first (autocast), so their own dtypes need not match (a LoRA run's frozen
    experts are stored in the compute dtype, the autocast input is fp32)."""
    if not hasattr(torch, "_grouped_mm") or (x.dtype != w.dtype and not cast):
        return False
    if any(s * dtype.itemsize % 16 for s in (w.shape[1], w.shape[2])):
        return False
    if x.is_cuda:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu":
        return False
    if dtype != torch.bfloat16 and (torch.compiler.is_compiling() or _is_fake(x)):
        return False
    return dtype in cpu_grouped_mm_dtypes()


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


@functools.cache
def cpu_grouped_mm_dtypes() -> frozenset:
    """The dtypes this torch's CPU `_grouped_mm` runs (forward and backward): a probe on tiny real
    tensors, once per process (older torch has no CPU kernel and raises). `GroupedExperts` runs it when
    it is built: inside a checkpointed forward its ops would pass through the AC policy."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    ok = set()
    with unset_fake_temporarily(), torch.enable_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            try:
                x = torch.ones(4, 8, dtype=dtype, device="cpu", requires_grad=True)
                w = torch.ones(2, 8, 8, dtype=dtype, device="cpu", requires_grad=True)
                offs = torch.tensor([1, 4], dtype=torch.int32, device="cpu")
                out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                out.backward(torch.ones_like(out))
                ok.add(dtype)
            except (RuntimeError, NotImplementedError, AttributeError):
                pass
    return frozenset(ok)


class GroupedExperts(nn.Module):
    """`bias`: each projection adds a per-expert bias (`b1`, `b3`: [experts, hidden], `b2`: [experts, dim];
    gpt-oss). `swiglu_clamp` (alpha, limit): gpt-oss's clamped SwiGLU, (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit), in place of silu(gate) * up."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        bias: bool = False,
        swiglu_clamp: Optional[tuple[float, float]] = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b1: Optional[nn.Parameter] = None
        self.b2: Optional[nn.Parameter] = None
        self.b3: Optional[nn.Parameter] = None
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden))
        for name in ("lora_gate_up_a", "lora_gate_up_b", "lora_down_a", "lora_down_b"):
            self.register_parameter(name, None)
        self.scaling = 1.0
        self.adapters_off = False  # True inside lora.adapters_disabled (DPO's reference: the base alone)
        self.act = partial(clamped_swiglu, alpha=swiglu_clamp[0], limit=swiglu_clamp[1]) if swiglu_clamp else swiglu
        cpu_grouped_mm_dtypes()

    # LoRA on the routed experts (peft.target_experts; dtlaunch.models.lora.adapt_experts): PEFT's
    # `target_parameters` adapters of the fused gate_up and down tensors, per expert e
    #   [w1_e; w3_e] += scaling * B_gu[e] @ A_gu[e]   (A_gu [E, r, dim], B_gu [E, 2F, r], gate rows first)
    #   w2_e += scaling * B_d[e] @ A_d[e]             (A_d [E, r, F], B_d [E, dim, r])
    # merged into the weights each forward, as PEFT's ParamWrapper does. None when not adapted.
    lora_gate_up_a: Optional[nn.Parameter]
    lora_gate_up_b: Optional[nn.Parameter]
    lora_down_a: Optional[nn.Parameter]
    lora_down_b: Optional[nn.Parameter]

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] grouped by expert (expert 0's rows first); num_tokens_per_expert: int64 [local experts]."""
        w1, w2, w3 = self.local_weights()
        biases = None if self.b1 is None else tuple(local_tensor(b) for b in (self.b1, self.b2, self.b3))
        return self.compute(x, num_tokens_per_expert, w1, w2, w3, biases)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w2, w3 as this rank holds them, with the adapters' update merged in (in the weights' dtype)."""
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        if self.lora_gate_up_a is None or self.adapters_off:
            return w1, w2, w3
        # Each update from its own rows of B, the scaling on B (small): backward then makes one weight-sized
        # gradient per weight, no fused gate_up gradient assembled from two slices.
        a, b = local_tensor(self.lora_gate_up_a), local_tensor(self.lora_gate_up_b) * self.scaling
        f = w1.shape[1]
        w1 = w1 + torch.bmm(b[:, :f], a).to(w1.dtype)
        w3 = w3 + torch.bmm(b[:, f:], a).to(w3.dtype)
        a, b = local_tensor(self.lora_down_a), local_tensor(self.lora_down_b) * self.scaling
        return w1, w2 + torch.bmm(b, a).to(w2.dtype), w3

    def compute(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1, w2, w3, biases: Biases) -> torch.Tensor:
        """The experts on these (local) weights; `biases` (b1, b2, b3), b2 may be None (added by the caller:
        tensor parallel adds it once, after summing the ranks' partial outputs)."""
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        if grouped_mm_supported(x, w1, dtype, cast=autocast):
            cast = None if biases is None else tuple(None if b is None else b.to(dtype) for b in biases)
            return _grouped(*(t.to(dtype) for t in (x, w1, w2, w3)), num_tokens_per_expert, self.act, cast)
        return _looped(x, w1, w2, w3, num_tokens_per_expert, self.act, biases)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation, as transformers' GptOssExperts computes it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Biases = Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]]


def _looped(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counts: torch.Tensor,
    act: Act = swiglu,
    biases: Biases = None,
) -> torch.Tensor:
    sizes = [int(c) for c in counts.tolist()]
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"GroupedExperts: {sum(sizes)} tokens counted for {x.shape[0]} rows")
    outs = []
    none = [None] * len(sizes)
    b1s, b2s, b3s = (none, none, none) if biases is None else tuple(none if b is None else b.unbind(0) for b in biases)
    # unbind, not w1[e]: indexing's backward allocates a zero tensor of the whole stack per expert
    # (E x the parameter size per block); unbind's stacks the experts' gradients once.
    experts = zip(torch.split(x, sizes), w1.unbind(0), w2.unbind(0), w3.unbind(0), b1s, b2s, b3s, strict=True)
    for rows, a, b, c, ba, bb, bc in experts:
        if rows.shape[0]:
            outs.append(F.linear(act(F.linear(rows, a, ba), F.linear(rows, c, bc)), b, bb))
    # No token at all: an empty result still depends on the weights (their gradient is zero, not None).
    if not outs:
        touch = (
            w1.sum() + w2.sum() + w3.sum() + (0 if biases is None else sum(b.sum() for b in biases if b is not None))
        )
        return x.new_zeros(0, w2.shape[1]) + 0 * touch
    return torch.cat(outs)


def _grouped(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counts: torch.Tensor,
    act: Act = swiglu,
    biases: Biases = None,
) -> torch.Tensor:
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    if biases is None:
        return torch._grouped_mm(act(gate, up), w2.transpose(-2, -1), offs=offs)
    # Each row's expert, without reading the counts on the host (output_size: no sync).
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0])
    b1, b2, b3 = biases
    out = torch._grouped_mm(act(gate + b1[expert], up + b3[expert]), w2.transpose(-2, -1), offs=offs)
    return out if b2 is None else out + b2[expert]
