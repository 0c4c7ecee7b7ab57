"""Preference tuning's terms in the memory plan (objective=dpo / orpo / simpo / kto; dtlaunch.train.objectives).

- Every sample is a pair: a micro-batch runs 2 x micro_batch rows (the stage's token count doubles); a KTO
  example is its own row and its KL row (dtlaunch.train.objectives.kto), both in the policy's forward.
- DPO's (and KTO's) reference, by kind (dtlaunch.train.objectives.reference):
  a frozen copy (full fine-tuning, or reference=hf:DIR) is held for the whole run: its linears in the
  compute dtype, embedding and norm gains fp32, sharded like the policy under FSDP;
  adapters off (LoRA / QLoRA with reference=base) holds nothing more;
  precomputed holds nothing during training.
- The reference forward (no grad) runs before the policy's, its own phase: what the rank holds for the
  whole step, plus the larger of its logits moment (the logits, their fp32 copy and log_softmax's output)
  and a layer's moment (expert parallel's all-to-all buffers, context parallel's gathered K/V).
- The precompute pass (objective.precompute_reference) is a phase of its own, before the first step: the
  parameters, the reference copy (if any) and one reference forward; no gradients, no optimizer state yet.
- Under pipeline parallel the reference (a copy split into stages, or the policy's stages with adapters
  off) runs through the stages one pipeline micro-batch at a time: a stage that receives holds the hidden
  states it received and those it sends on; the last stage, the logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dtlaunch.config.decisions import head_unit
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.plan.cp_terms import forward_exchange_bytes
from dtlaunch.plan.experts import all_to_all_bytes
from dtlaunch.plan.lines import Line
from dtlaunch.plan.loss_terms import loss_chunks

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

PHASE_REFERENCE = "reference forward"
PHASE_PRECOMPUTE = "reference pass (before training)"
# What exists before the first step (no optimizer state, gradients or buckets yet).
_HELD_BEFORE_TRAINING = (Line.PARAMETERS, Line.ADAPTER_PARAMETERS, Line.NF4_BASE_WEIGHTS, Line.BUFFERS)


def reference_kind(cfg: JobConfig) -> str:
    """none | adapters_off | copy; precomputed references report how the pass computes them. objective=grpo
    holds one only for its KL term (objective.beta > 0): its reference forward runs in the rollout."""
    name = str(cfg.objective.name)
    if name not in ("dpo", "kto") and not (name == "grpo" and float(cfg.objective.beta) > 0):
        return "none"
    if str(cfg.objective.reference) == "base" and str(cfg.peft.method) != "none":
        return "adapters_off"
    return "copy"


def precomputed(cfg: JobConfig) -> bool:
    return cfg.objective.name in (ObjectiveName.dpo, ObjectiveName.kto) and bool(cfg.objective.precompute_reference)


def copy_bytes(c: Any) -> float:
    """The frozen reference copy on this rank: linears in the compute dtype, embedding and norms fp32."""
    head = c.vocab_params if c.last_stage and not c.tied_head else 0
    linears = c.layers * (c.block_params - c.block_norm_params) + head
    fp32 = (
        (c.vocab_params if c.first_stage else 0) + c.layers * c.block_norm_params + (c.model.dim if c.last_stage else 0)
    )
    return (c.compute_bytes * linears + 4 * fp32) / (c.shard_ranks if c.fsdp else 1)


def reference_static_lines(c: Any) -> dict[str, float]:
    """What the reference adds to the whole step."""
    if reference_kind(c.cfg) == "copy" and not precomputed(c.cfg):
        return {Line.REFERENCE_COPY: copy_bytes(c)}
    return {}


def reference_layer_bytes(c: Any) -> float:
    """The running layer's exchange buffers in a reference forward: expert parallel's all-to-all dispatch /
    combine buffers (as in the policy's forward) and context parallel's K/V gathered from the CP ranks (no
    gradients, unlike backward's exchange). No grad: one layer's at a time, none kept across layers. The
    layer's own working set (SwiGLU's or the experts' intermediates, its gathered block) is not counted."""
    if not c.layers:
        return 0.0
    layer = all_to_all_bytes(c.cfg, c.ep, c.tokens, c.compute_bytes)
    if c.cp > 1:
        layer += forward_exchange_bytes(c)
    return layer


def reference_head_bytes(c: Any) -> float:
    """The reference's head and log-probs on the last stage: over the whole micro-batch
    (training.loss_chunks=1) the logits (compute dtype), their fp32 copy (none in fp32) and log_softmax's
    fp32 output; chunked, the same for one chunk of the tokens, the per-token values, the head gathered as
    a unit of its own under FSDP (an untied head without TP) and, under sequence parallel, the hidden
    states gathered once."""
    per_token = (c.compute_bytes + (4 if c.compute_bytes != 4 else 0) + 4) * c.block_dims.vocab / c.tp
    n = loss_chunks(c)
    if n == 1:
        return per_token * c.tokens
    gathered = c.compute_bytes * c.vocab_params if _head_unit(c) else 0.0
    sp_hidden = c.compute_bytes * c.block_dims.h * c.tokens if c.sequence_parallel else 0.0
    return per_token * math.ceil(c.tokens / n) + 4 * c.tokens + gathered + sp_hidden


def _head_unit(c: Any) -> bool:
    """Under FSDP with the chunked head, an untied head without TP is a unit of its own (the frozen copy's,
    or the policy's with its adapters off), gathered only while the head runs."""
    chunks = loss_chunks(c)
    return c.fsdp and chunks > 1 and head_unit(False, c.tied_head, owns_head=True, loss_chunks=chunks, tp=c.tp)


def reference_forward_bytes(c: Any) -> float:
    """Transient of one reference forward on top of what the rank holds: the larger of two moments that do
    not overlap (no grad frees a layer's buffers before the next layer runs): a layer's exchange buffers
    (`reference_layer_bytes`) and, on the last stage, the head's (`reference_head_bytes`); under ZeRO-3
    the root unit gathered for the whole forward on top (with the head in it). Under pipeline parallel a
    rank without the last stage also holds a pipeline micro-batch's hidden states twice (received and sent
    on; sequence-parallel ones are 1 / tp of the sequence).
    Measured (real 2-rank gloo runs, a StorageCounter around the reference call, 1,024 tokens a rank):
    the all-to-all buffers add 4.8 MiB to the MoE layer's moment (planner_moe, EP(2) against none; planned
    4.1 MiB) and the K/V gather 3.3 MiB to attention's (planner7m, CP(2); planned 2.0 MiB)."""
    layer = reference_layer_bytes(c)
    if not c.last_stage:
        transit = (
            2 * _hidden_bytes(c) * c.model.dim * c.tokens / (c.tp if c.sequence_parallel else 1) if c.pp > 1 else 0.0
        )
        return transit + layer
    root = c.compute_bytes * c.root_params if c.fsdp and c.zero_stage == 3 and not _head_unit(c) else 0.0
    return max(reference_head_bytes(c), layer) + root


def _hidden_bytes(c: Any) -> int:
    """Bytes per element of the hidden states between stages: fp32 under autocast, else the compute dtype."""
    return 4 if c.fp32_residual else c.compute_bytes


def reference_phases(c: Any, static: dict[str, float]) -> dict[str, float]:
    """The extra phases: the live reference forward, or the precompute pass before training."""
    if reference_kind(c.cfg) == "none":
        return {}
    if precomputed(c.cfg):
        held = sum(v for k, v in static.items() if k in _HELD_BEFORE_TRAINING)
        copy = copy_bytes(c) if reference_kind(c.cfg) == "copy" else 0.0
        return {PHASE_PRECOMPUTE: held + copy + reference_forward_bytes(c)}
    return {PHASE_REFERENCE: sum(static.values()) + reference_forward_bytes(c)}
