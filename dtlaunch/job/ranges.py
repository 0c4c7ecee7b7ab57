"""The allowed range of every numeric schema field, as data: one table keyed by the field's dotted path.

`check_ranges` (run first by `validate`) reads the table; a value outside its range, or a float that is
not finite (nan, inf), is a ConfigError naming the key, the value, the range and an example fix. A test
checks that every int/float field of the schema has an entry, so a new field gets a rule too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass(frozen=True)
class Range:
    """min <= value <= max (strict where `*_open`), or one of `also` (e.g. -1 = "the rest")."""

    min: Optional[float] = None
    max: Optional[float] = None
    min_open: bool = False
    max_open: bool = False
    also: tuple = ()
    meaning: str = ""  # what the extra values mean, for the message

    def allows(self, value: float) -> bool:
        if value in self.also:
            return True
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        if self.max is not None and (value >= self.max if self.max_open else value > self.max):
            return False
        return True

    def describe(self) -> str:
        if self.min is not None and self.max is not None:
            text = (
                f"in {'(' if self.min_open else '['}{_num(self.min)}, {_num(self.max)}{')' if self.max_open else ']'}"
            )
        elif self.min is not None:
            text = f"{'>' if self.min_open else '>='} {_num(self.min)}"
        elif self.max is not None:
            text = f"{'<' if self.max_open else '<='} {_num(self.max)}"
        else:
            text = "finite"
        if self.also:
            text += " or " + " or ".join(_num(a) for a in self.also) + (f" ({self.meaning})" if self.meaning else "")
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(0, min_open=True)
AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1)  # [0, 1]
PROBABILITY = Range(0, 1, max_open=True)  # [0, 1): Adam betas, a fragmentation share
DEGREE = Range(1, also=(-1,), meaning="-1 = the rest of the world")
STEP_OR_OFF = Range(0, also=(-1,), meaning="-1 = off")

RANGES: dict[str, Range] = {
    "model.dim": AT_LEAST_1,
    "model.n_layers": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1,
    "model.vocab_size": AT_LEAST_1,
    "model.multiple_of": AT_LEAST_1,
    "model.ffn_dim_multiplier": POSITIVE,
    "model.ffn_dim": AT_LEAST_1,
    "model.norm_eps": POSITIVE,
    "model.rope_theta": POSITIVE,
    "model.max_seq_len": AT_LEAST_1,
    "model.head_dim": AT_LEAST_1,
    "model.sliding_window": AT_LEAST_1,
    "model.no_rope_layers": NON_NEGATIVE,  # block indices (smollm3; its check bounds them by n_layers)
    # gemma3's own: the sliding layers' RoPE base, the attention scale's divisor, the full layers' linear
    # RoPE factor, and the norm gain's offset (1.0, fixed by the family).
    "model.rope_local_theta": POSITIVE,
    "model.query_pre_attn_scalar": POSITIVE,
    "model.rope_linear_factor": POSITIVE,
    "model.norm_offset": NON_NEGATIVE,
    # gpt_oss's own: the experts' clamped SwiGLU, YaRN RoPE.
    "model.swiglu_alpha": POSITIVE,
    "model.swiglu_limit": POSITIVE,
    "model.rope_yarn.factor": POSITIVE,
    "model.rope_yarn.original_max_seq_len": AT_LEAST_1,
    "model.rope_yarn.beta_fast": POSITIVE,
    "model.rope_yarn.beta_slow": POSITIVE,
    "model.rope_yarn.attention_factor": POSITIVE,
    "model.rope_scaling.factor": POSITIVE,
    "model.rope_scaling.low_freq_factor": POSITIVE,
    "model.rope_scaling.high_freq_factor": POSITIVE,
    "model.rope_scaling.original_max_seq_len": AT_LEAST_1,
    "model.moe.num_experts": NON_NEGATIVE,  # 0 = dense
    "model.moe.top_k": AT_LEAST_1,
    "model.moe.expert_dim": AT_LEAST_1,
    "model.moe.num_shared_experts": NON_NEGATIVE,
    "model.moe.shared_expert_dim": AT_LEAST_1,
    "model.moe.aux_loss_coef": NON_NEGATIVE,
    "model.moe.bias_update_rate": NON_NEGATIVE,
    "model.moe.sparse_step": AT_LEAST_1,
    "model.moe.dense_layers": NON_NEGATIVE,  # lists: every element
    "model.moe.n_group": AT_LEAST_1,
    "model.moe.topk_group": AT_LEAST_1,
    "model.moe.routed_scaling": POSITIVE,
    # glm4_moe's own: the share of each head's dims RoPE rotates.
    "model.partial_rotary_factor": Range(0, 1, min_open=True),
    # qwen3_next's and qwen3_5(_moe)'s own: the Gated DeltaNet blocks' heads, widths and convolution.
    "model.linear_num_key_heads": AT_LEAST_1,
    "model.linear_num_value_heads": AT_LEAST_1,
    "model.linear_key_head_dim": AT_LEAST_1,
    "model.linear_value_head_dim": AT_LEAST_1,
    "model.linear_conv_kernel_dim": AT_LEAST_1,
    # deepseek_v3's own: the latent attention's widths (null q_lora_rank: one q projection), its YaRN.
    "model.q_lora_rank": AT_LEAST_1,
    "model.kv_lora_rank": AT_LEAST_1,
    "model.qk_nope_head_dim": NON_NEGATIVE,
    "model.qk_rope_head_dim": AT_LEAST_1,  # and even (its check)
    "model.v_head_dim": AT_LEAST_1,
    "model.yarn.factor": POSITIVE,
    "model.yarn.original_max_seq_len": AT_LEAST_1,
    "model.yarn.beta_fast": POSITIVE,
    "model.yarn.beta_slow": POSITIVE,
    "model.yarn.mscale": NON_NEGATIVE,  # 0: absent
    "model.yarn.mscale_all_dim": NON_NEGATIVE,
    "strategy.dp_replicate": DEGREE,
    "strategy.dp_shard": DEGREE,
    "strategy.tp": DEGREE,
    "strategy.pp": DEGREE,
    "strategy.cp": AT_LEAST_1,  # an explicit degree: it must also split training.seq_len
    "strategy.zero_stage": Range(0, 3),
    "strategy.ep": AT_LEAST_1,
    "strategy.pp_microbatches": NON_NEGATIVE,
    "strategy.pp_stages_per_rank": AT_LEAST_1,
    "strategy.pp_layers_per_stage": AT_LEAST_1,  # lists: every element
    "training.micro_batch": AT_LEAST_1,
    "training.global_batch": NON_NEGATIVE,
    "training.seq_len": AT_LEAST_1,
    "training.steps": AT_LEAST_1,
    "training.seed": NON_NEGATIVE,  # numpy's seed sequences take non-negative seeds only
    "training.grad_clip": NON_NEGATIVE,
    "training.max_bad_steps": NON_NEGATIVE,
    "training.log_every": AT_LEAST_1,
    "training.sync_interval_s": NON_NEGATIVE,  # 0 = one collective per log_every steps exactly
    "training.straggler_threshold": NON_NEGATIVE,  # 0 = off
    "training.ac_every_n_layers": AT_LEAST_1,  # 1 = every block
    "training.ac_memory_budget": Range(0, 1),  # 0 = no budget, 1 = what compile saves anyway
    "training.eval_every": NON_NEGATIVE,  # 0 = no evaluation
    "training.eval_batches": AT_LEAST_1,
    "training.eval_limit": NON_NEGATIVE,  # 0 = every sample
    "training.eval_num_fewshot": Range(-1),  # -1 = each task's own
    "training.eval_batch_size": AT_LEAST_1,
    "training.mlp_tiles": NON_NEGATIVE,  # 0 = from the plan
    "training.loss_chunks": NON_NEGATIVE,  # 0 = auto, 1 = one full-vocabulary pass
    "optim.lr": POSITIVE,
    "optim.min_lr_ratio": FRACTION,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": PROBABILITY,
    "optim.beta2": PROBABILITY,
    "optim.eps": POSITIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "data.max_bytes": NON_NEGATIVE,
    "data.val_fraction": PROBABILITY,
    "checkpoint.every_steps": AT_LEAST_1,
    "checkpoint.keep_last": AT_LEAST_1,
    "hardware.memory_gib": POSITIVE,
    "hardware.peak_tflops_bf16": NON_NEGATIVE,
    "hardware.peak_tflops_fp32": NON_NEGATIVE,
    "hardware.gpus_per_node": NON_NEGATIVE,
    "hardware.intra_node_gbps": NON_NEGATIVE,
    "hardware.inter_node_gbps": NON_NEGATIVE,
    "hardware.context_gib": NON_NEGATIVE,
    "hardware.comm_buffers_gib": NON_NEGATIVE,
    "hardware.fragmentation": PROBABILITY,
    "hardware.host_memory_gib": NON_NEGATIVE,  # 0 = unknown
    "hardware.memory_gbps": NON_NEGATIVE,  # 0 = unknown (generation time from FLOPs alone)
    "hardware.host_link_gbps": NON_NEGATIVE,  # 0 = unknown (offload transfers then assumed PCIe 4.0 x16)
    "launch.nnodes": AT_LEAST_1,
    "launch.nproc_per_node": NON_NEGATIVE,
    "launch.node_rank": Range(0, also=(-1,), meaning="-1 = from the scheduler"),
    "launch.max_restarts": NON_NEGATIVE,
    "launch.timeout_s": AT_LEAST_1,
    "launch.threads_per_worker": NON_NEGATIVE,
    "launch.flight_recorder_entries": NON_NEGATIVE,  # 0 = off
    "cluster.nodes": AT_LEAST_1,
    "cluster.gpus_per_node": NON_NEGATIVE,
    "cluster.cpus_per_task": NON_NEGATIVE,
    "cluster.signal_before_s": NON_NEGATIVE,
    "cluster.sky.rdzv_port": Range(1, 65535),
    "cluster.sky.max_restarts_on_errors": NON_NEGATIVE,
    "peft.rank": AT_LEAST_1,
    "peft.alpha": POSITIVE,
    "peft.dropout": PROBABILITY,
    "peft.nf4_block_size": AT_LEAST_1,
    "peft.nf4_scaler_block_size": AT_LEAST_1,
    "objective.beta": NON_NEGATIVE,  # 0: objective=grpo without a KL term (the preference losses need > 0)
    "objective.num_generations": Range(2),  # a group of one has no spread to centre on
    "objective.epsilon": Range(0, 1, max_open=True),
    "objective.epsilon_high": POSITIVE,
    "objective.num_iterations": AT_LEAST_1,
    "objective.max_completion_length": AT_LEAST_1,
    "objective.temperature": POSITIVE,
    "objective.top_p": Range(0, 1, min_open=True),
    "objective.top_k": NON_NEGATIVE,
    "objective.importance_sampling_clip_max": POSITIVE,
    "objective.importance_sampling_clip_min": NON_NEGATIVE,  # 0: no lower bound
    "objective.reward_weights": Range(),
    "objective.max_tool_calling_iterations": NON_NEGATIVE,  # None (unset): until a turn makes no call
    "objective.tool_timeout_s": NON_NEGATIVE,  # 0: calls run in the worker, no timeout
    "objective.tool_memory_mb": NON_NEGATIVE,  # 0: no limit
    "objective.label_smoothing": Range(0, 0.5, max_open=True),  # 0.5: the loss divides by 1 - 2 * it
    "objective.sft_weight": NON_NEGATIVE,  # 0 = off
    "objective.gamma": NON_NEGATIVE,
    "objective.desirable_weight": NON_NEGATIVE,
    "objective.undesirable_weight": NON_NEGATIVE,
    "objective.center_rewards_coefficient": NON_NEGATIVE,  # None (unset): off
    "plan.moe_imbalance": Range(1),  # 1 = perfectly balanced experts
    "debug.fail_at_step": STEP_OR_OFF,
    "debug.fail_rank": NON_NEGATIVE,
    "debug.hang_at_step": STEP_OR_OFF,
    "debug.slow_save_s": NON_NEGATIVE,
    "debug.hold_at_step": STEP_OR_OFF,
    "debug.slow_step_s": NON_NEGATIVE,
    "debug.nan_at_steps": AT_LEAST_1,
    "profiling.steps": AT_LEAST_1,
    "profiling.every": NON_NEGATIVE,
    "profiling.warmup": NON_NEGATIVE,
}


def _schema_default(key: str) -> Any:
    from omegaconf import OmegaConf

    from dtlaunch.job.model_schema import job_schema, schema_node

    return OmegaConf.select(schema_node(job_schema()), key, default=None)


def check_ranges(cfg: JobConfig, notes: list[str]) -> None:
    """Every numeric field inside its range, and finite."""
    from omegaconf import OmegaConf

    for key, rule in RANGES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_list(value):
            for i, item in enumerate(value):
                _check_one(f"{key}[{i}]", item, rule, None)
        else:
            _check_one(key, value, rule, key)


def _check_one(key: str, value: Any, rule: Range, default_of: Optional[str]) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # unset optional fields (model.ffn_dim, model.rope_scaling) have no value to check
    finite = math.isfinite(value)
    if finite and rule.allows(value):
        return
    default = _schema_default(default_of) if default_of else None
    example = f", e.g. {key}={default}" if default is not None and rule.allows(default) else ""
    what = "is not a finite number" if not finite else "is out of range"
    raise ConfigError(f"{key}={value} {what}: set {key} to a value {rule.describe()}{example}")
