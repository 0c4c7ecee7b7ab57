"""objective=grpo's rollout in the layout search's step time (dtlaunch.plan.search.step_time).

A rollout (dtlaunch.train.objectives.rollout) serves objective.num_iterations optimizer steps; per step it
costs 1/num_iterations of:
- the prefill: one forward over this rank's rows' prompts (rows = global_batch / dp completions);
- max_completion_length decode steps, each a forward of one token per row that reads every weight and the
  KV cache filled so far: the slower of its FLOPs at the sustained peak and those bytes at the device's
  memory bandwidth (hardware.memory_gbps; FLOPs alone when it is 0). Decode is memory bound on a GPU, so
  data parallelism does not shorten it: every rank reads the whole model once per generated token;
- under tensor parallel each rank reads and computes 1/tp of that, and every forward waits on two
  collectives per block (the attention's and the MLP's all-reduce, or sequence parallel's all-gather and
  reduce-scatter) and the logits' gather: their bytes at the link's bandwidth plus a fixed latency each
  (TP_COLLECTIVE_LATENCY_S), which is what bounds TP decoding of small batches;
- under FSDP (ZeRO-2/3), the parameters all-gathered once (dtlaunch.train.parallel.generation_gather),
  on the critical path; one unit at a time (objective.generation_gather=unit), once for every forward;
- the no-grad passes over the rows: the old policy's (num_iterations > 1) and the reference's (beta > 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.decisions import Decisions
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.models.dense.shapes import head_dim, kv_heads
from dtlaunch.models.dtypes import DTYPE_BYTES
from dtlaunch.models.registry import model_spec
from dtlaunch.plan import hardware

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# Seconds one small collective of a decode step costs on the critical path, whatever its size: the order of
# NCCL's published small-message all-reduce latency inside an NVLink node (nccl-tests, tens of microseconds).
TP_COLLECTIVE_LATENCY_S = 20e-6


def generation_seconds(cfg: JobConfig, dec: Decisions, efficiency: float) -> float:
    """Seconds per optimizer step that objective=grpo's rollout adds (0 for the other objectives)."""
    o, m, t, hw = cfg.objective, cfg.model, cfg.training, cfg.hardware
    if o.name != ObjectiveName.grpo:
        return 0.0
    lay = dec.layout
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    params = model_spec(m).param_count(m)
    flops_per_s = hardware.peak_flops(hw, cfg.precision.param_dtype) * efficiency
    rows = dec.global_batch // lay.dp
    completion = int(o.max_completion_length)
    prompt = int(t.seq_len) - completion
    tp = lay.tp
    prefill = 2 * params * rows * prompt / flops_per_s / tp
    # One rank's cache per position: the family's own (DeepSeek-V3's latent, whole on every rank), else
    # its heads' keys and values.
    own = model_spec(m).kv_cache_values
    values = own(m, tp) if own is not None else 2 * kv_heads(m) * head_dim(m) / tp
    kv_per_position = int(m.n_layers) * values * rows * e
    bandwidth = float(hw.memory_gbps) * 1e9
    # One term per decode step would cost the search ~completion iterations per layout: the mean KV cache
    # (half the completion filled) gives the same sum for the linear byte count.
    step_bytes = params * e / tp + kv_per_position * (prompt + completion / 2)
    step_flops = 2 * params * rows / flops_per_s / tp
    decode = completion * max(step_flops, step_bytes / bandwidth if bandwidth else 0.0)
    if tp > 1:
        collectives = 2 * int(m.n_layers) + 1
        link = hardware.link_bandwidth(hw, tp, 1)
        step_comm = (tp - 1) / tp * rows * (2 * int(m.n_layers) * int(m.dim) + int(m.vocab_size)) * e / link
        prefill += (tp - 1) / tp * rows * prompt * 2 * int(m.n_layers) * int(m.dim) * e / link
        decode += completion * (step_comm + collectives * TP_COLLECTIVE_LATENCY_S)
    gather = 0.0
    if lay.shard > 1 and int(cfg.strategy.zero_stage) >= 2:
        bw = hardware.link_bandwidth(hw, lay.shard, lay.tp)
        gather = (lay.shard - 1) / lay.shard * params * e / bw
        if dec.generation_gather == "unit":
            gather *= 1 + completion  # the prefill and every decode step gather the model again
    passes = dec.keeps_old_logps + (float(o.beta) > 0)
    no_grad = passes * 2 * params * rows * int(t.seq_len) / flops_per_s
    return (prefill + decode + gather + no_grad) / int(o.num_iterations)
