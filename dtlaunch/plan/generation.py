"""objective=grpo's rollout phases in the memory plan (dtlaunch.train.objectives.rollout).

Generation runs between optimizer steps, while the rank holds what it holds for the whole step (the
static lines: parameters, optimizer state, a reference copy) but no gradients and no activations:
- the KV cache, preallocated for every row this rank generates at once (global_batch / dp completions)
  over prompt + completion <= training.seq_len positions: layers x 2 x kv width / tp x rows x seq_len x
  the compute dtype's bytes (dtlaunch.infer.batch_generate; under sequence parallel the prompt block
  padded to a multiple of tp and tp - 1 decode fillers more); a family caching something else per
  position says what (ModelSpec.kv_cache_values: DeepSeek-V3's kv_lora_rank + qk_rope_head_dim, not
  divided by tp), and what its blocks keep on their caches for the whole generation
  (ModelSpec.decode_derived_values: DeepSeek-V3's absorbed wkv_b matrix, layers x wkv_b's weight / tp);
- the larger of two moments that do not overlap: the prefill's working set in one block (no grad: one
  block at a time; q, k, v, the attention output and SwiGLU's three ffn-wide tensors over the prompts'
  tokens) and one step's logits (the prefill projects only its last position: vocab / tp wide) with the
  sampling buffers (fp32 logits, probabilities, top-p's sorted copy and cumulative sum: rows x vocab x 4
  bytes each);
- under FSDP the whole model gathered: no unit reshards between the rollout's forwards, so the weights
  are all-gathered once per rollout (dtlaunch.train.parallel.generation_gather); with ZeRO-3 and
  objective.generation_gather=unit (or auto, when only that fits) one unit at a time instead, gathered
  for each forward and resharded after it, as in a training forward: the root unit (its head and final
  norm a static line already, its embedding on top) and, at the largest other unit's all-gather (a
  block, or a head of its own), that unit's flat all-gather output and the storage it is copied into
  (gloo, a CPU profile, holds one more copy).
The old policy's pass (dtlaunch.config.decisions.Decisions.keeps_old_logps) is a no-grad forward over the rows, micro-batch by
micro-batch: the same moment as a reference forward (dtlaunch.plan.objective.reference_forward_bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.config.schema import ObjectiveName
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.hardware import GLOO_EXTRA_BUFFER_COPIES, gloo_collectives
from dtlaunch.plan.lines import Line
from dtlaunch.plan.objective import reference_forward_bytes

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

PHASE_GENERATION = "generation"
# One unit's all-gather: the flat output and the unsharded storage it is copied into exist together.
# Measured by tests/distributed/test_plan_accuracy.py::test_predicted_peak_matches_real_grpo_runs (the
# generation-bound row with objective.generation_gather=unit; real gloo runs).
UNIT_GATHER_COPIES = 2
PHASE_OLD_POLICY = "old-policy forward"


def generation_rows(c: Any) -> int:
    """The completions this rank generates at once: its share of the global batch."""
    return int(c.accum_steps) * int(c.training.micro_batch)


def prompt_positions(c: Any) -> int:
    """The prompt block's width: the prompt room, padded to the decode multiple (sequence parallel)."""
    m = c.decisions.decode_positions_multiple
    return -(-(int(c.training.seq_len) - int(c.cfg.objective.max_completion_length)) // m) * m


def kv_cache_values(c: Any) -> float:
    """Values one block caches per position and row on one rank: the family's own (ModelSpec.kv_cache_values:
    DeepSeek-V3's latent and shared rotated key, whole on every TP rank), else the keys and values of this
    rank's heads."""
    own = model_spec(c.model).kv_cache_values
    return own(c.model, c.tp) if own is not None else 2 * c.block_dims.k / c.tp


def kv_cache_bytes(c: Any) -> float:
    """Keys and values for the prompt block, every completion position and a decode step's fillers, and what
    each block derives for the generation and keeps on its cache (ModelSpec.decode_derived_values)."""
    positions = (
        prompt_positions(c) + int(c.cfg.objective.max_completion_length) + c.decisions.decode_positions_multiple - 1
    )
    derived = model_spec(c.model).decode_derived_values
    per_block = kv_cache_values(c) * generation_rows(c) * positions + (derived(c.model, c.tp) if derived else 0)
    return c.layers * per_block * c.compute_bytes


def prefill_rows(c: Any) -> int:
    """The rows the prefill runs: each distinct prompt once (its G completions copy its cache;
    dtlaunch.infer.batch_generate). A rank's rows may start and end inside a group: one prompt more."""
    rows, g = generation_rows(c), max(1, int(c.cfg.objective.num_generations))
    return min(rows, -(-rows // g) + (1 if rows % g else 0))


def decode_bytes(c: Any) -> float:
    """The larger of the prefill's block working set (a row per distinct prompt) and one step's logits with
    its sampling buffers (the prefill projects its last position only; under tensor parallel the logits are
    gathered whole first)."""
    rows, d, prompt = generation_rows(c), c.block_dims, prompt_positions(c)
    # The heads and the FFN width are split over TP; the block's input and output are not.
    block = prefill_rows(c) * prompt * ((d.qw + 2 * d.k + 3 * d.f) / c.tp + d.h) * c.compute_bytes
    gathered = rows * d.vocab * c.compute_bytes if c.tp > 1 else 0.0
    # The sampler correction keeps each drawn token's log-prob: one more fp32 (rows, vocab) log-softmax.
    buffers = 4 + bool(c.cfg.objective.importance_sampling_correction)
    sampling = buffers * rows * d.vocab * 4 + gathered
    # A step's positions (sequence parallel: one per TP rank) through the head's vocab / tp columns.
    kept = c.decisions.decode_positions_multiple
    logits = rows * kept * (d.vocab / c.tp) * c.compute_bytes + sampling if c.last_stage else 0.0
    return max(block, logits)


def gathered_bytes(c: Any, gather: str = "whole") -> float:
    """The FSDP parameters unsharded in the compute dtype while generating, beside the shards: every unit's
    (`gather` "whole"), or, one unit at a time ("unit"), the largest unit beyond what the static lines hold
    gathered anyway (the root unit's head and final norm: dtlaunch.plan.stage.static_lines)."""
    if not c.fsdp:
        return 0.0
    if gather == "unit":
        own_head = c.vocab_params if c.last_stage and c.head_unit else 0
        embedding = c.vocab_params if c.first_stage else 0
        copies = UNIT_GATHER_COPIES + (GLOO_EXTRA_BUFFER_COPIES if gloo_collectives(c.cfg.hardware) else 0)
        return c.compute_bytes * (embedding + copies * max(c.gathered_block_params, own_head))
    return c.compute_bytes * c.gathered_params


def generation_phases(c: Any, static: dict[str, float], gather: str = "whole") -> dict[str, float]:
    if c.cfg.objective.name != ObjectiveName.grpo:
        return {}
    held = sum(_between_steps(static).values())
    phases = {PHASE_GENERATION: held + kv_cache_bytes(c) + decode_bytes(c) + gathered_bytes(c, gather)}
    if c.decisions.keeps_old_logps:
        phases[PHASE_OLD_POLICY] = held + reference_forward_bytes(c)
    return phases


def generation_lines(c: Any, static: dict[str, float], gather: str = "whole") -> dict[str, float]:
    """The generation phase's lines (when it is the stage's peak)."""
    lines = {**_between_steps(static), Line.KV_CACHE: kv_cache_bytes(c), Line.PREFILL_SAMPLING_BUFFERS: decode_bytes(c)}
    if gathered_bytes(c, gather):
        held = lines.get(Line.UNSHARDED_PARAMETERS, 0.0) if gather == "unit" else 0.0
        lines[Line.UNSHARDED_PARAMETERS] = held + gathered_bytes(c, gather)
    return lines


def _between_steps(static: dict[str, float]) -> dict[str, float]:
    """What the rank holds between optimizer steps: the gradients were freed by the last step."""
    return {k: v for k, v in static.items() if k != Line.ACCUMULATED_GRADIENTS}


def tool_process_bytes(cfg: JobConfig) -> float:
    """Host RAM of the rank's user-code process (objective.tools, environments, user reward functions in a
    child process, dtlaunch.inputs.tools): at most its address-space limit, objective.tool_memory_mb. 0 when
    none runs (no user code, objective.tool_timeout_s 0: it runs in the worker) or it has no limit."""
    o = cfg.objective
    if o.name != ObjectiveName.grpo or float(o.tool_timeout_s) <= 0:
        return 0.0
    from dtlaunch.inputs.rewards import user_rewards

    if not (list(o.tools) or str(o.environment) or _entries(o.environments) or user_rewards(o)):
        return 0.0
    return float(int(o.tool_memory_mb) * 2**20)


def _entries(mapping: Any) -> int:
    """A config mapping's size: a DictConfig, or the plain namespace the layout search plans with."""
    try:
        return len(mapping)
    except TypeError:
        return len(vars(mapping))
