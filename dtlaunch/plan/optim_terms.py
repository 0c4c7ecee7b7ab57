"""The memory planner's optimizer terms (`optim.name`, `optim.state_dtype`, `optim.in_backward`; pure
Python, never imports torch). dtlaunch.plan.shape and dtlaunch.plan.stage apply them.

- AdamW (torch): two moments in the parameter's dtype, 8 bytes per trained fp32 element; with
  optim.state_dtype=bf16 the adapters themselves train in bf16 (weights, gradients, moments: 2 + 2 + 4);
- torchao's AdamW8bit / AdamW4bit (dtlaunch.train.features.optim_lowbit): per parameter tensor, on the rank's
  local tensor (its FSDP2 shard), a moment is quantised only when the tensor has >= 4096 elements and
  divides by the block (256 / 128 elements): 8-bit codes (or 4-bit, two a byte), one fp32 scale per
  block and the code table (256 / 16 fp32 entries) per moment; smaller tensors keep fp32 moments;
- step temporaries: torch's foreach AdamW on CPU one temporary the size of the local state (fused on
  GPU: none); torchao's update run eagerly (the CPU measurements) holds 24 bytes per element of the
  tensor being updated (measured with the runtime's storage counter); compiled on a GPU its fused
  kernel is planned at 8 (an estimate: the two moments' fp32 values before re-quantisation);
- step in backward: no model-wide gradients at the step; in backward one tensor's update at a time
  (its gradient is freed right after).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOWBIT = {"adamw8bit": (256, 1.0, 256), "adamw4bit": (128, 0.5, 16)}  # block, bytes per code, table entries
MIN_QUANTISED = 4096
# torchao's low-bit AdamW update run eagerly: bytes per element of the tensor being updated (the runtime's
# storage counter, CPU).
# Measured by tests/distributed/test_plan_accuracy.py::test_predicted_peak_matches_real_optimizer_option_runs
EAGER_TEMP = 24
COMPILED_TEMP = 8  # an estimate, not a measurement: the fused kernel's two moments' fp32 values


@dataclass(frozen=True)
class OptimTerms:
    name: str
    in_backward: bool
    grad_bytes: int  # per trained element
    param_bytes: int  # per trained element (the adapters under LoRA / QLoRA)
    state: float  # the optimizer state on one rank
    temp: float  # the step's temporaries on one rank (one tensor's under in_backward)
    temp_block: float = 0.0  # in_backward: the largest block tensor's (updated inside a block's backward)


def moment_bytes(name: str, numel: int, param_bytes: int = 4) -> float:
    """Bytes of one moment of a local tensor of `numel` elements."""
    if name not in LOWBIT:
        return param_bytes * numel
    block, code, table = LOWBIT[name]
    if numel >= MIN_QUANTISED and numel % block == 0:
        return code * numel + 4 * (numel // block) + 4 * table
    return 4 * numel


def local_numel(rows: int, cols: int, shards: int) -> int:
    """Elements of the most loaded FSDP2 row shard (torch.chunk: ceil(rows / shards) rows)."""
    return -(-rows // shards) * cols


def trained_tensors(c: Any) -> tuple[list[int], list[int]] | None:
    """Local element counts of the stage's trained tensors on its most loaded rank: one block's, and the
    root's (embedding, final norm, head) (None when the family gives no linear shapes: the planner then
    counts every element as quantised)."""
    from dtlaunch.models.registry import model_spec

    spec = model_spec(c.model)
    if spec.block_linears is None:
        return None
    linears = dict(spec.block_linears(c.model))
    shards = c.shard_ranks if c.fsdp else 1
    out: list[int] = []
    if c.peft:
        rank = int(c.cfg.peft.rank)
        from dtlaunch.plan.peft import adapted

        for name in adapted(c.cfg, list(linears)):
            o, i, _ = linears[name]
            out += [local_numel(rank, i, shards), local_numel(o, rank, shards)]
        return out, []
    h = int(c.model.dim)
    per_block = [local_numel(o, i, shards) for o, i, _ in linears.values()]
    norms, rest = divmod(c.block_norm_params, h)
    per_block += [local_numel(1, h, shards)] * norms + ([rest] if rest else [])
    other = c.block_params - sum(o * i for o, i, _ in linears.values()) - c.block_norm_params
    if other > 0:
        per_block.append(-(-other // shards))
    out = []
    if c.first_stage:
        out.append(local_numel(int(c.model.vocab_size), h, shards))
    if c.last_stage:
        if not c.tied_head:
            out.append(local_numel(int(c.model.vocab_size), h, shards))
        out.append(local_numel(1, h, shards))
    return per_block, out


def optim_terms(c: Any, fused: bool) -> OptimTerms:
    """The optimizer terms of a stage `c` (dtlaunch.plan.shape.StageShape); `fused`: GPU kernels."""
    o = c.cfg.optim
    name = str(o.name)
    bf16 = str(o.state_dtype) == "bf16" and c.peft is not None
    elem = 2 if bf16 else 4
    shards = c.shard_ranks if c.fsdp or c.zero_stage == 1 else 1
    shapes = trained_tensors(c)
    tensors = shapes[0] * c.layers + shapes[1] if shapes else None
    biggest_block = max(shapes[0], default=0) if shapes else c.trained_params / max(1, c.layers) / shards
    if name in LOWBIT:
        if tensors is None:
            block, code, table = LOWBIT[name]
            state = 2 * (code + 4 / block) * c.trained_params / shards
            largest = c.trained_params / max(1, c.layers) / shards
        else:
            state = sum(2 * moment_bytes(name, n) for n in tensors)
            largest = max(tensors, default=0)
        per_elem = COMPILED_TEMP if fused else EAGER_TEMP
        temp = per_elem * largest  # one tensor at a time, after backward or inside it
        temp_block = per_elem * biggest_block
    else:
        state = 2 * elem * c.trained_params / shards
        largest = max(tensors, default=0) if tensors else c.trained_params / max(1, c.layers) / shards
        whole = 0.0 if fused else elem * c.trained_params / shards
        temp = (0.0 if fused else elem * largest) if o.in_backward else whole
        temp_block = 0.0 if fused else elem * biggest_block
    return OptimTerms(
        name=name,
        in_backward=bool(o.in_backward),
        grad_bytes=elem,
        param_bytes=elem,
        state=state,
        temp=temp,
        temp_block=temp_block,
    )
