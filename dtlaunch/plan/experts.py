"""What expert parallel changes in the per-rank memory plan (pure Python, never imports torch).

Routed-expert parameters are split `ep` ways and then FSDP-sharded over the dp_shard / ep ranks left,
so their sharded bytes (parameters, gradients, AdamW state) are those of plain FSDP over dp_shard;
what shrinks is everything FSDP *unshards*: a gathered block holds only its 1/ep of the experts. Tensor
parallel splits each routed expert on its width instead (and cannot combine with expert parallel). The token dispatch adds
all-to-all buffers: the busiest rank receives more than its balanced share of routed token copies
(`rank_imbalance`, from `plan.moe_imbalance`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.models.registry import model_spec, routed_experts

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def stage_routed_params(m: Any, layer_ids: list[int]) -> int:
    """Routed-expert parameters of the blocks `layer_ids` (0 for a dense model)."""
    if not routed_experts(m):
        return 0
    from dtlaunch.models.moe.shapes import layer_params

    return sum(layer_params(m, i)["routed"] for i in layer_ids)


def stage_whole_under_tp(m: Any, layer_ids: list[int]) -> int:
    """Parameters of the blocks `layer_ids` that tensor parallel leaves whole on every rank (0 for a dense
    model): each sparse block's router and, with expert biases (gpt-oss), the down projections' biases,
    added once after the ranks' partial outputs are summed (dtlaunch.train.parallel.tensor_parallel), and
    every block's matrices its family keeps whole (deepseek_v3's low-rank projections)."""
    attention = model_spec(m).tp_whole_block_params(m) * len(layer_ids)
    if not routed_experts(m):
        return attention
    from dtlaunch.models.moe.shapes import is_sparse

    dim, experts = int(m.dim), int(m.moe.num_experts)
    per = experts * (dim + (1 if getattr(m, "router_bias", False) else 0))
    per += experts * dim if getattr(m, "expert_biases", False) else 0
    return attention + per * sum(is_sparse(m, i) for i in layer_ids)


def imbalance(cfg: JobConfig) -> float:
    """plan.moe_imbalance: the busiest expert's routed copies over the mean (what training logs)."""
    plan = getattr(cfg, "plan", None)
    return float(getattr(plan, "moe_imbalance", 1.0)) if plan is not None else 1.0


def rank_imbalance(cfg: JobConfig, ep: int) -> float:
    """The busiest EP rank's routed copies over the mean. Exact at the two ends: 1 when one rank holds
    every expert, plan.moe_imbalance when each rank holds one; in between a rank's load sums E / ep
    experts' and evens out, interpolated linearly in the rank count. (The bench's EP rows, 4 experts a
    rank: measured peaks showed no extra routed load over the mean.)"""
    experts = routed_experts(cfg.model)
    if ep <= 1 or experts <= 1:
        return 1.0
    return 1.0 + (imbalance(cfg) - 1.0) * (ep - 1) / (experts - 1)


def all_to_all_bytes(cfg: JobConfig, ep: int, tokens: int, e: int) -> float:
    """Dispatch/combine buffers of the MoE layer in flight: the received token copies (busiest rank) and
    their expert-major copy; on the way back the outputs and their rank-major copy, the same size."""
    m = cfg.model
    if ep <= 1 or not routed_experts(m):
        return 0.0
    copies = tokens * int(m.moe.top_k) * rank_imbalance(cfg, ep)
    return 2.0 * e * copies * int(m.dim)


def a2a_volume_bytes(cfg: JobConfig, ep: int, tokens: int, e: int) -> float:
    """Bytes one rank sends per MoE layer and micro-batch, forward + backward (4 all-to-alls): the
    (ep - 1) / ep of its routed copies that leave for other ranks."""
    m = cfg.model
    if ep <= 1 or not routed_experts(m):
        return 0.0
    return 4.0 * (ep - 1) / ep * tokens * int(m.moe.top_k) * int(m.dim) * e


def grouped_gemm(cfg: JobConfig) -> bool:
    """Whether the runtime computes the routed experts with torch's grouped GEMM rather than one matmul
    per expert (dtlaunch.models.moe.experts.grouped_mm_supported), which changes what the op-level
    selective AC saves. Rows must be multiples of 16 bytes. GPU: Hopper profiles in bf16 (torch's fast
    kernel needs sm90). CPU: every torch this project supports has the kernel, except under compile in
    fp32 (torch's shape function takes bf16 only)."""
    from dtlaunch.models.dtypes import DTYPE_BYTES
    from dtlaunch.models.moe.shapes import expert_dim

    e = DTYPE_BYTES[cfg.precision.param_dtype]
    if (int(cfg.model.dim) * e) % 16 or (expert_dim(cfg.model) * e) % 16:
        return False
    hw = cfg.hardware
    if int(hw.gpus_per_node) > 0:
        return e == 2 and cfg.precision.param_dtype == "bf16" and str(hw.name).startswith(("h100", "h200"))
    return not (bool(cfg.training.compile) and e == 4)
