"""The typed job schema: the one place where every default lives.

Each dataclass is a config group (or a section) of the composed job. Hydra's ConfigStore registers
the tree so that YAML groups, recipes and command-line overrides are merged *into* these types:
an unknown key or a value of the wrong type fails at compose time, before anything starts.

Nothing here imports torch: `dtlaunch --help`, `plan` and `validate` must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from typing import Any, Optional


@dataclass
class RopeScalingConfig:
    """Llama-3.1 RoPE frequency scaling (absent for Llama 2 and tiny models)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


# Metadata of a model field that is a training choice rather than a property of the weights: it keeps
# its own value when the model section comes from a checkpoint's config.json (model.init_from=hf:DIR).
TRAINING_CHOICE = {"training_choice": True}


@dataclass
class ModelConfig:
    """The fields every model family shares; `arch` picks the family (dtlaunch/models/registry.py).

    A family's own fields live with the family: its registry entry names a subclass of this class
    (models/dense/config.py adds qkv_bias, qk_norm, sliding_window; models/moe/config.py adds `moe`), and
    a composed job's model section is typed by that subclass (dtlaunch/job/model_schema.py). Width
    rules follow Meta's reference implementation unless ffn_dim / head_dim are set.
    """

    name: str = field(default="tiny", metadata=TRAINING_CHOICE)
    # Registry entry: llama, qwen2, qwen3, mistral, ... (`dtlaunch recipes` and docs/models.md list them).
    arch: str = "llama"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    # None means "same as n_heads" (multi-head attention); fewer heads give GQA.
    n_kv_heads: Optional[int] = None
    vocab_size: int = 256
    # FFN width = multiple_of * ceil(ffn_dim_multiplier * floor(8*dim/3) / multiple_of);
    # ffn_dim overrides the rule when a published size does not follow it.
    multiple_of: int = 32
    ffn_dim_multiplier: float = 1.0
    ffn_dim: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScalingConfig] = None
    max_seq_len: int = field(default=2048, metadata=TRAINING_CHOICE)
    # Per-head width; None = dim // n_heads (Qwen3 sets it independently of dim).
    head_dim: Optional[int] = None
    # Output head shares the token-embedding matrix (Llama 3.2 1B/3B, small Qwen).
    tie_embeddings: bool = False
    # Your own module instead of a registry entry: "pkg.module.build", a callable taking this model
    # section and returning an nn.Module that follows docs/models.md's protocol (planned by trace).
    _target_: str = ""
    # A model family of your own, outside dtlaunch: the importable module that registers it
    # (dtlaunch.models.registry.register) under the name set in model.arch; see docs/models.md.
    family_module: str = ""
    # Where initial weights come from: "random" (seeded init) or "hf:DIR" (safetensors export).
    init_from: str = field(default="random", metadata=TRAINING_CHOICE)


@dataclass
class StrategyConfig:
    """The parallel layout. Degrees multiply to the world size; -1 means "the rest of the world"."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    # Context parallel: each sequence split over this many ranks (load-balanced chunks); parameters are
    # sharded over dp_shard x cp.
    cp: int = 1
    # How attention spans the split sequence (CpStyle): ring (K/V of the whole sequence exchanged, every
    # head on every rank) or ulysses (an all-to-all turns sequence shards into head shards around attention).
    cp_style: CpStyle = field(default_factory=lambda: CpStyle.ring)
    # 0 = DDP, 1 = optimizer state sharded, 2 = + gradients sharded, 3 = + parameters (FSDP full shard)
    zero_stage: int = 0
    sequence_parallel: bool = True
    # A schedule of PP_SCHEDULES by its short name, or any torch.distributed.pipelining Schedule* class name.
    pp_schedule: str = "1f1b"
    # Micro-batches per step through the pipeline (each micro_batch / pp_microbatches samples).
    pp_microbatches: int = 0
    # Virtual stages per pipeline rank (2+ for interleaved schedules).
    pp_stages_per_rank: int = 1
    # Layers per pipeline stage, e.g. [3, 5]; empty = as even as possible.
    pp_layers_per_stage: list[int] = field(default_factory=list)
    # Expert parallel (mixture-of-experts models): routed experts split over `ep` ranks taken from the
    # data-parallel shard ranks (ep divides dp_shard), not extra ranks; needs FSDP (zero_stage >= 2).
    ep: int = 1
    # FSDP under a pipeline: false keeps the stage's gradients unsharded across the step's micro-batches
    # and reduce-scatters once after the last (torch's and torchtitan's way: least communication, but the
    # whole stage's unsharded gradients stay allocated); true reduce-scatters after every micro-batch's
    # backward (sharded gradients only, one reduce-scatter per micro-batch). The plan models both.
    pp_reshard_grads: bool = False
    # FSDP2 CPU offload (CPUOffloadPolicy): parameter shards, gradients and AdamW state live in host memory
    # and the optimizer steps on the CPU; the device holds only the units being gathered and activations.
    # Needs FSDP (zero_stage 2 or 3); the plan counts the host bytes against hardware.host_memory_gib.
    cpu_offload: bool = False


# Pipeline schedules by our name -> torch.distributed.pipelining class; other torch class names also work.
PP_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
MULTI_STAGE_SCHEDULES = {"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv"}
# Schedules whose backward runs as separate input- and weight-gradient passes.
SPLIT_BACKWARD = ("ZeroBubble", "ZBV", "DualPipe")


@dataclass
class PrecisionConfig:
    param_dtype: Dtype = field(default_factory=lambda: Dtype.fp32)
    reduce_dtype: Dtype = field(default_factory=lambda: Dtype.fp32)
    # Dynamic loss scaling; required for fp16 (validated), ignored otherwise.
    loss_scaling: bool = False
    # Float8 matmuls in the blocks' linears through torchao (none | tensorwise | rowwise scaling); needs
    # a hardware profile with float8 tensor cores (hardware.float8: Hopper, Blackwell).
    float8: Float8Recipe = field(default_factory=lambda: Float8Recipe.none)
    # Test and debug path, not a speed feature: torchao's emulated float8 matmuls (the same casts and scales,
    # products computed in fp32) let precision.float8 run on CPU or GPUs without float8 tensor cores.
    float8_emulate: bool = False
    # The residual stream between the blocks (what full activation checkpointing keeps per block, and
    # its gradient in backward). auto: today's behaviour, fp32 under autocast (DDP, one process: the
    # fp32 embedding's output and fp32 residual adds) and the compute dtype under FSDP's mixed precision;
    # bf16 / fp16: the compute dtype under autocast too (as an all-bf16 model keeps it: half the bytes,
    # rounding each residual add; loss difference measured in docs/long-context.md); fp32: fp32 (autocast only).
    residual_dtype: ResidualDtype = field(default_factory=lambda: ResidualDtype.auto)


@dataclass
class TrainingConfig:
    micro_batch: int = 4
    # Samples per optimizer step over all data-parallel ranks; 0 = micro_batch * dp (no accumulation).
    global_batch: int = 0
    seq_len: int = 128
    steps: int = 20
    seed: int = 1234
    activation_checkpointing: AcMode = field(default_factory=lambda: AcMode.none)
    # Selective AC policy. op: inside each block save attention's output and every other matmul's,
    # recompute the rest; layer: checkpoint (fully) every ac_every_n_layers-th block, keep the others.
    ac_policy: AcPolicy = field(default_factory=lambda: AcPolicy.op)
    ac_every_n_layers: int = 2
    # Selective AC under compile by torch's activation-memory-budget partitioner instead of a policy:
    # the fraction (0..1] of the compiled graph's saved activations to keep; 0 = off.
    ac_memory_budget: float = 0.0
    compile: bool = False
    # The blocks' saved activations (under activation checkpointing: the checkpointed block inputs) move to
    # pinned host memory in forward and back in backward, on a side CUDA stream; the output head's and the
    # loss's stay on the device. Same losses; costs host memory and host-link time (both planned).
    # null (default): on where it costs no step time (config.decisions: full activation
    # checkpointing on a GPU profile with host RAM, no pipeline parallel); true / false: as set.
    activation_offload: Optional[bool] = None
    # Each block's SwiGLU MLP runs over this many tiles of the sequence, each recomputed in backward, so a
    # block never holds its [tokens x FFN width] intermediates whole (dtlaunch.train.features.tiled_mlp, ALST's
    # TiledMLP). 0: from the plan (config.decisions: tiles of at most 8192 tokens, so untiled up to
    # 8192 tokens per micro-batch); 1: untiled.
    mlp_tiles: int = 0
    grad_clip: float = 1.0
    # Non-finite loss or grad norm: skip the step; stop after this many in a row.
    max_bad_steps: int = 3
    log_every: int = 1
    # The ranks agree on the loss, the bad-step flags and a stop signal in one collective per logging
    # window. When steps are fast the windows widen (a whole multiple of log_every, the same on every
    # rank) so that those collectives are at least this many seconds apart: on CPU/gloo each costs
    # ~0.7 ms, 4 % of a tiny model's step. Metrics lines and a stop then lag by up to ~2x this. 0: off.
    sync_interval_s: float = 0.1
    # Validation loss every eval_every steps and at the last step (0 = never); eval_batches global
    # batches of the validation set each time (always the same ones, so the curve is comparable).
    eval_every: int = 0
    eval_batches: int = 4
    # lm-evaluation-harness tasks run on the final checkpoint once the workers have exited, as `dtlaunch
    # eval RUN --tasks ...` runs them (results in RUN/eval/); empty = off. The rest: eval's own options.
    eval_tasks: list[str] = field(default_factory=list)
    eval_limit: int = 0  # samples per task at most; 0 = all
    eval_num_fewshot: int = -1  # -1 = each task's own
    eval_batch_size: int = 8
    eval_include: str = ""  # a directory of task YAML files of one's own
    eval_apply_chat_template: bool = False
    # The output head and the cross-entropy run over this many chunks of the tokens, each recomputed in
    # backward, so the (tokens x vocab) logits and their fp32 gradients never exist whole: 8 (torchtune's
    # choice) cuts that peak to an eighth for one extra head matmul per token. 1 = one full-vocabulary pass.
    # 0 = auto: 8 where one rank's micro-batch logits reach 64 MiB in fp32, else 1 (config.decisions:
    # below that the chunks save no memory worth their extra matmul and ~560 more ops a step); on a GPU
    # profile the plan takes 1 wherever that fits (plan.memory.plan_memory: the chunks cost up to 9 % of a
    # step on an H200), and the launcher writes its choice into the run's config.yaml.
    loss_chunks: int = 0
    # loss.png (loss and lr against step) when the run ends: importing matplotlib and drawing take ~1 s.
    loss_plot: bool = True
    # Name a rank whose own time per step (its step period less its wait for the latest rank to start the
    # step) is this fraction above the other ranks' median, on the live line and in the summary. 0 = off.
    straggler_threshold: float = 0.10


@dataclass
class OptimConfig:
    # adamw: torch's AdamW; adamw8bit / adamw4bit: torchao's low-bit AdamW (block-quantised moments,
    # the 'lowbit-optim' extra; dtlaunch.train.features.optim_lowbit).
    name: OptimName = field(default_factory=lambda: OptimName.adamw)
    # The AdamW moments' dtype. bf16 trains the LoRA / QLoRA adapters in bf16 (weights, gradients and
    # moments, as torchtune does); full training keeps fp32 masters and refuses it (validate).
    state_dtype: StateDtype = field(default_factory=lambda: StateDtype.fp32)
    # Each parameter's update runs as soon as its gradient is complete (a post-accumulate-grad hook),
    # then the gradient is freed: no model-wide gradients at the step (dtlaunch.train.features.optim_in_backward).
    in_backward: bool = False
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    schedule: LrSchedule = field(default_factory=lambda: LrSchedule.cosine)


class Choice(str, Enum):
    """A schema choice: OmegaConf refuses other values at compose time; in code it is its plain name
    (compares equal to, prints and formats as the string)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Dtype(Choice):
    """A floating-point format of parameters, compute and reductions."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ResidualDtype(Choice):
    """The dtype of the residual stream between the blocks (see PrecisionConfig.residual_dtype)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Float8Recipe(Choice):
    """torchao's float8 scaling of the blocks' linears (none: no float8)."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class CpStyle(Choice):
    """How context parallel attends over a sequence split across ranks (docs/long-context.md)."""

    # Each rank keeps all heads of its own tokens and gathers every rank's K/V (ring attention): any
    # head count, exchange grows with the whole sequence.
    ring = "ring"
    # DeepSpeed-Ulysses: an all-to-all trades sequence shards for head shards, each rank attends over the
    # whole sequence for heads / cp heads with the plain kernel, and back; exchange stays per-rank sized.
    ulysses = "ulysses"


class AcMode(Choice):
    """Activation checkpointing of the blocks."""

    none = "none"
    selective = "selective"
    full = "full"


class AcPolicy(Choice):
    """What selective activation checkpointing keeps (see TrainingConfig.ac_policy)."""

    op = "op"
    layer = "layer"


class LrSchedule(Choice):
    """The learning rate's decay after warmup."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OptimName(Choice):
    """Which AdamW implementation steps the parameters."""

    adamw = "adamw"
    adamw8bit = "adamw8bit"
    adamw4bit = "adamw4bit"


class StateDtype(Choice):
    fp32 = "fp32"
    bf16 = "bf16"


class DataKind(Choice):
    """Where training text comes from (a str Enum: compares equal to its name in code and YAML)."""

    synthetic = "synthetic"  # random tokens (benchmarks)
    tokens = "tokens"  # prepared .bin shards (`dtlaunch data prepare`)
    text = "text"  # plain text files, one document each
    jsonl = "jsonl"  # one JSON object per line
    parquet = "parquet"  # a column of Parquet files (pyarrow)
    hf = "hf"  # a Hugging Face dataset: save_to_disk directory or local data files (datasets, offline)


class DataFormat(Choice):
    """What one record of a jsonl / parquet / hf source holds."""

    text = "text"  # a string in data.text_field
    chat = "chat"  # a list of {role, content} in data.messages_field; loss on assistant tokens only
    prompt_completion = "prompt_completion"  # data.prompt_field + data.completion_field; loss on the completion
    # data.prompt_field + data.chosen_field + data.rejected_field (objective=dpo / orpo / simpo)
    preference = "preference"
    # data.prompt_field + data.completion_field + data.label_field: unpaired completions, each desirable (true)
    # or not (false); objective=kto (TRL's unpaired preference format)
    unpaired = "unpaired"
    # data.prompt_field only (objective=grpo: the completions are generated); every other column reaches
    # the reward functions.
    prompt = "prompt"


class PeftMethod(Choice):
    """Which parameters train: all of them, or low-rank adapters on a frozen base."""

    none = "none"  # full training
    lora = "lora"  # adapters on a frozen base in the training dtype
    qlora = "qlora"  # adapters on a frozen base stored as 4-bit NF4 (torchao)


# Hugging Face module names an adapter can go on (a model accepts those it has); `all-linear` = every
# linear of the blocks (never the output head), as peft reads it.
ALL_LINEAR = "all-linear"


# peft.targets' default, also read by dtlaunch.models.lora.select_targets: the default, and only the default,
# leaves out MLP names a model with routed experts does not have (experts take no adapters).
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning: the base weights are frozen, only the adapters train.

    An adapted linear computes W x + (alpha / rank) * B A dropout(x), with A [rank, in] and B [out, rank];
    B starts at zero, so training starts from the base model's exact outputs.
    """

    method: PeftMethod = PeftMethod.none
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Hugging Face module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or
    # all-linear. Default: attention's q, v, output and the MLP, torchtune's shipped Llama-3 LoRA choice
    # (k adds little, the MLP adapters most of the quality; the output head stays frozen). Where the MLP is
    # routed experts only (Mixtral), the default adapts the attention (the experts: peft.target_experts).
    targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    # Also adapt every MoE block's routed experts (their fused gate_up and down stacks, one rank-`rank`
    # adapter per expert), as PEFT's `target_parameters` does; exported so peft loads it.
    target_experts: bool = False
    # qlora: elements per NF4 quantization block, and blocks per scaler block (torchao's / torchtune's).
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256


class ObjectiveName(Choice):
    """What the loop minimises (dtlaunch/train/objectives/)."""

    sft = "sft"  # next-token cross-entropy (pre-training, SFT)
    dpo = "dpo"  # direct preference optimisation against a reference model
    orpo = "orpo"  # odds-ratio preference optimisation: NLL on chosen + odds-ratio term, no reference
    simpo = "simpo"  # length-normalised preference margin with a target gap, no reference
    kto = "kto"  # Kahneman-Tversky optimisation: unpaired desirable / undesirable completions, a reference model
    grpo = "grpo"  # online RL: sampled completions scored by reward functions (GRPO family, TRL's names)
    reward = "reward"  # a reward model: a scalar head trained on preference pairs (Bradley-Terry, TRL's RewardTrainer)


class PreferenceLoss(Choice):
    """objective=dpo: the function of the log-ratio margin; objective=kto: kto or apo_zero_unpaired (TRL's names)."""

    sigmoid = "sigmoid"  # -log sigmoid(beta * margin)
    ipo = "ipo"  # (length-normalised margin - 1 / (2 beta))^2
    hinge = "hinge"  # relu(1 - beta * margin)
    robust = "robust"  # label-noise-robust DPO (uses objective.label_smoothing)
    kto = "kto"  # objective=kto: 1 - sigmoid(beta * (log-ratio - KL estimate)), mirrored for undesirable ones
    apo_zero_unpaired = "apo_zero_unpaired"  # objective=kto: APO-zero's unpaired form, no KL estimate


class GRPOLossType(Choice):
    """objective=grpo: how the per-token losses are aggregated (TRL's loss_type; trl/trainer/grpo_trainer.py)."""

    grpo = "grpo"  # mean over each completion's tokens, then over completions (length bias)
    dr_grpo = "dr_grpo"  # sum over tokens / (completions x max_completion_length) (Dr. GRPO)
    dapo = "dapo"  # sum over the generation batch's tokens / their count (TRL's default)
    bnpo = "bnpo"  # sum over the micro-batch's tokens / their count
    cispo = "cispo"  # clipped importance weight (detached) x advantage x log-prob, aggregated as dapo


class ImportanceLevel(Choice):
    """objective=grpo: the policy ratio per token, or one per completion (GSPO: the mean log-ratio)."""

    token = "token"
    sequence = "sequence"


class GenerationGather(Choice):
    """objective=grpo under FSDP ZeRO-3: how the rollout holds the weights while it generates."""

    auto = "auto"  # whole when the plan fits so, else unit (the launcher writes its choice into config.yaml)
    whole = "whole"  # every unit gathered once per rollout, kept for all decode steps (fast)
    unit = "unit"  # one unit at a time, gathered again for every decode step (the whole model never held)


class ImportanceSamplingMode(Choice):
    """objective=grpo's correction for the sampler's numerics (TRL's vllm_importance_sampling_mode): the ratio
    of the training policy's probability to the sampler's, per token or per completion (the tokens' log-ratios
    summed), clipped to [clip_min, clip_max] (truncate) or zeroed outside it (mask)."""

    token_truncate = "token_truncate"
    token_mask = "token_mask"
    sequence_truncate = "sequence_truncate"
    sequence_mask = "sequence_mask"


class ScaleRewards(Choice):
    """objective=grpo: divide the group-centred reward by the group's std, the batch's std, or nothing."""

    group = "group"
    batch = "batch"
    none = "none"


@dataclass
class ObjectiveConfig:
    """The training objective. Preference objectives read data.format=preference pairs; log-probs are
    sums over completion tokens (prompt and padding excluded), as TRL's DPOTrainer computes them."""

    name: ObjectiveName = ObjectiveName.sft
    loss: PreferenceLoss = PreferenceLoss.sigmoid
    # DPO / SimPO: inverse temperature of the margin; ORPO: weight of the odds-ratio term (TRL's defaults).
    beta: float = 0.1
    # loss=robust only: the assumed fraction of flipped labels. loss=sigmoid ignores it, as TRL >= 0.29 does
    # (torchtune's "conservative DPO" applies it to sigmoid; here use loss=robust for a noise-aware loss).
    label_smoothing: float = 0.0
    # DPO: weight of an NLL term on the chosen completion (RPO; TRL's loss_type=[sigmoid, sft]); 0 = off.
    sft_weight: float = 0.0
    # KTO: the weights of the desirable and the undesirable examples' losses (TRL's; to counter an imbalance).
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # SimPO: the target reward gap (TRL's simpo_gamma): loss -log sigmoid(beta * avg-logp margin - gamma).
    gamma: float = 0.5
    # DPO's reference: "base" (LoRA / QLoRA: the same model with the adapters switched off; full fine-tuning:
    # a frozen copy of the initial weights sharded like the policy), "hf:DIR" (a Hugging Face model directory,
    # e.g. a chosen SFT model), or a dtlaunch run directory RUN_DIR or one of its checkpoints
    # (RUN_DIR/checkpoints/step-XXXXXXXX; the newest complete one for a run; a LoRA / QLoRA run: its base with
    # the adapters merged). The reference must be the architecture trained (checked before launch).
    reference: str = "base"
    # One pass before training writes every pair's reference log-probs beside the token cache; training
    # then holds no reference model and runs no reference forward.
    precompute_reference: bool = False
    # objective=reward: weight of TRL's mean-zero term, coefficient x mean((r(y+) + r(y-))^2) (TRL's
    # center_rewards_coefficient; its paper recommends 0.01); None: off, as TRL.
    center_rewards_coefficient: Optional[float] = None
    # objective=grpo (online RL; dtlaunch.train.objectives.grpo), TRL's GRPOConfig names. `beta` above is the
    # KL weight to the reference (configs/objective/grpo.yaml sets 0: no reference held, none computed).
    num_generations: int = 8  # G completions sampled per prompt; training.global_batch counts completions
    loss_type: GRPOLossType = GRPOLossType.dapo
    importance_sampling_level: ImportanceLevel = ImportanceLevel.token
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float = 0.28  # upper clip (DAPO's clip-higher); cispo: the cap of the detached ratio
    num_iterations: int = 1  # mu: optimizer steps on each generation batch (old-policy log-probs kept)
    scale_rewards: ScaleRewards = ScaleRewards.group
    # Completions cut at max_completion_length (no EOS / end-of-turn) contribute no loss.
    mask_truncated_completions: bool = False
    # Reward functions: built-ins `accuracy`, `format`, or `module:function` / `path/to/file.py:function`
    # with TRL's signature f(prompts=, completions=, completion_ids=, **columns) -> list[float | None].
    rewards: list[str] = field(default_factory=lambda: ["accuracy"])
    reward_weights: list[float] = field(default_factory=list)  # empty: 1 for each reward function
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # FSDP ZeRO-3 only: the weights for generation gathered whole (once per rollout) or one unit at a time
    # (per decode step: slower, the whole model never held); auto: whole unless only unit fits the plan.
    generation_gather: GenerationGather = GenerationGather.auto
    # The decode steps compiled (torch.compile against a static KV cache; CUDA graphs on CUDA): one compile
    # per run, then each step replays it. Off by default: the compile costs its seconds even on short runs.
    generation_compile: bool = False
    # The sampler's own log-probs kept with each completion and the loss weighted by the training policy's
    # probability over the sampler's (TRL's vllm_importance_sampling_correction, there for vLLM): where they
    # differ (compiled or low-precision decoding) the tokens are reweighted, clipped or masked. Off by default:
    # the sampler here is the training model, and the correction costs a no-grad pass of the rollout's rows.
    importance_sampling_correction: bool = False
    importance_sampling_mode: ImportanceSamplingMode = ImportanceSamplingMode.sequence_mask
    importance_sampling_clip_max: float = 3.0
    importance_sampling_clip_min: float = 0.0  # 0: no lower bound (TRL's None)
    format_regex: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"  # the `format` reward's pattern
    answer_field: str = "answer"  # the `accuracy` reward compares against this dataset column
    # Tools the model may call while it generates (TRL's `tools`): `module:function` / `path/to/file.py:function`,
    # each with type hints and a docstring (its JSON schema, rendered into chat prompts). A call's result is
    # appended as a `tool` message and generation continues; tool-result tokens are masked out of the loss.
    tools: list[str] = field(default_factory=list)
    # Tool-call rounds per completion (TRL's max_tool_calling_iterations); None: until no call is made (each
    # completion's assistant and tool tokens together stay within max_completion_length either way).
    max_tool_calling_iterations: Optional[int] = None
    # Each tool call (and each call of a user reward function or environment) runs in a child process of the
    # rank, killed (the call answered with an error; a reward's stops the run) after this long; 0: in the
    # worker itself, without a timeout or a memory limit.
    tool_timeout_s: float = 30.0
    # That child process's address space (MiB, RLIMIT_AS): a call that exhausts it is answered with an error
    # and the process replaced. 0: no limit. The plan counts it as host RAM per rank.
    tool_memory_mb: int = 4096
    # An environment (TRL's environment_factory): `module:Class` / `path/to/file.py:Class`, one instance per
    # rollout in the tools' process: `reset(**record)` before generation (a returned text is appended to the
    # last prompt message), its public methods the rollout's tools, an optional `get_reward()` scoring the
    # rollout (weight 1, logged under the class's name) beside objective.rewards.
    environment: str = ""
    # Several environments, name -> factory, each prompt's selected by its dataset column `environment`
    # (TRL's dict environment_factory); instead of objective.environment.
    environments: dict[str, str] = field(default_factory=dict)


@dataclass
class DataConfig:
    kind: DataKind = DataKind.synthetic
    # tokens: a directory of shards or a glob; other kinds: a directory, file or glob.
    path: str = ""
    # "auto": the model's own tokenizer.json when model.init_from=hf:DIR, else "byte"; resolved once by the
    # launcher, so the run's config.yaml names the file used. "byte" (built-in, 256 ids + specials) or the
    # path of a Hugging Face tokenizer.json.
    tokenizer: str = "auto"
    # data.tokenizer=byte with a model.init_from=hf:DIR that has its own tokenizer is refused (ids that mean
    # nothing to the model); true trains on them anyway.
    force_tokenizer: bool = False
    # text kind: file pattern inside `path` when it is a directory (other kinds pick their own extension).
    pattern: str = "**/*.py"
    # Cap on text read for the built-in corpus (bytes), to keep start-up short.
    max_bytes: int = 0
    format: DataFormat = DataFormat.text
    # jsonl / parquet / hf: the record field (column) holding the document text.
    text_field: str = "text"
    messages_field: str = "messages"
    # data.format=chat or prompt: a built-in template (chatml, llama3, qwen, mistral) or the path of a Jinja
    # file; replaces the tokenizer's own chat_template. Empty: the tokenizer's (refused when it has none).
    chat_template: str = ""
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    # data.format=preference: the preferred and the dispreferred completion of data.prompt_field (text, or
    # lists of chat messages rendered with the run's chat template).
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # data.format=unpaired (objective=kto): the record's boolean, true for a desirable completion.
    label_field: str = "label"
    # objective=reward: the record field holding each pair's margin, a number (TRL's `margin` column: the loss
    # becomes -log sigmoid(r(chosen) - r(rejected) - margin)); empty: no margin.
    margin_field: str = ""
    # pack: documents are joined by EOS into full seq_len windows; false: one document per sample, cut at
    # seq_len and padded (padding is no target). document_mask (packed): each token attends only to
    # earlier tokens of its own document, and RoPE positions restart at each document.
    pack: bool = True
    document_mask: bool = False
    # hf: the split of a DatasetDict or of local data files.
    split: str = "train"
    # hf with data.path=ORG/NAME (a hub dataset): its configuration name (empty: the default one) and the
    # branch, tag or commit to read (empty: main); the launcher records the commit in config.yaml.
    subset: str = ""
    revision: str = ""
    # Tokenized jsonl / parquet / hf data is cached here by content (empty = $DTLAUNCH_DATA_CACHE or
    # ~/.cache/dtlaunch/tokens), so a second run with the same inputs and tokenizer skips tokenizing.
    cache_dir: str = ""
    # Validation: a separate source of the same kind (val_path) or a deterministic held-out fraction of
    # the training windows (val_fraction); at most one of the two.
    val_path: str = ""
    val_fraction: float = 0.0
    # hf: the split validation reads (empty: data.split), e.g. `validation` of the same hub dataset; a hub
    # data.val_path's branch, tag or commit (empty: main), recorded as its commit like data.revision.
    val_split: str = ""
    val_revision: str = ""


class Tracker(Choice):
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"


@dataclass
class WandbConfig:
    # offline: no account or network; the run lands in <run dir>/wandb (sync it later with `wandb sync`).
    mode: str = "offline"
    project: str = "dtlaunch"
    entity: str = ""


@dataclass
class MlflowConfig:
    # Empty = a local store in <run dir>/mlruns (an SQLite file: MLflow 3 refuses new plain-file stores).
    tracking_uri: str = ""
    experiment: str = "dtlaunch"


@dataclass
class LoggingConfig:
    # Where metrics go besides metrics.jsonl (always written), from global rank 0 only.
    trackers: list[Tracker] = field(default_factory=lambda: [Tracker.tensorboard])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 100
    keep_last: int = 2
    async_save: bool = False
    # Relative paths are inside the run directory.
    dir: str = "checkpoints"
    # Resume from this checkpoint instead of the newest one in the run directory.
    load_path: str = ""


@dataclass
class HardwareConfig:
    name: str = "cpu"
    memory_gib: float = 24.0
    # Dense peak throughput per device, TFLOP/s, by compute dtype (for MFU and the layout search).
    peak_tflops_bf16: float = 0.0
    peak_tflops_fp32: float = 0.0
    gpus_per_node: int = 0
    # Per-device unidirectional bandwidths, GB/s.
    intra_node_gbps: float = 0.0
    inter_node_gbps: float = 0.0
    # Memory the framework cannot use: CUDA context + communicator buffers (GiB); fraction lost to
    # allocator fragmentation. Shown as separate lines in the plan.
    context_gib: float = 0.0
    comm_buffers_gib: float = 0.0
    fragmentation: float = 0.0
    # Float8 tensor cores (Hopper, Ada, Blackwell): precision.float8 is refused on profiles without them.
    float8: bool = False
    # Host RAM of one node (GiB): offloaded activations and FSDP CPU offload's states of every rank on the
    # node are planned against it. 0 = unknown (offloading is then refused).
    host_memory_gib: float = 0.0
    # Host <-> device link per GPU, one direction (GB/s, PCIe): offload transfers in the step-time estimate.
    host_link_gbps: float = 0.0
    # Device memory bandwidth (GB/s, datasheet): a decode step reads every weight and the KV cache, so
    # objective=grpo's generation time in the layout search is bounded by it. 0 = unknown (FLOPs only).
    memory_gbps: float = 0.0


class WorkerStart(Choice):
    """How each worker process comes to exist (torchrun's agent starts, watches and stops them either way)."""

    auto = "auto"  # a fork of the launcher, which has imported what a worker needs; exec where GPUs are visible
    exec = "exec"  # a fresh `python -m dtlaunch.train.main` per worker, as plain torchrun starts them


@dataclass
class LaunchConfig:
    nnodes: int = 1
    # 0 = one per GPU, or 2 on a CPU machine.
    nproc_per_node: int = 0
    node_rank: int = -1
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    max_restarts: int = 0
    timeout_s: int = 300
    # auto: nccl when CUDA is available, else gloo.
    backend: str = "auto"
    # Threads per worker process on CPU (0 = cores / local workers).
    threads_per_worker: int = 0
    # Entries of torch's collective flight recorder per rank (TORCH_FR_BUFFER_SIZE; 0 = off). A collective
    # that times out makes every rank dump its record to RUN/flight_recorder/ for `torchfrtrace`.
    flight_recorder_entries: int = 2000
    # auto: CPU workers are forks of the launcher (seconds of imports saved per start and restart).
    worker_start: WorkerStart = WorkerStart.auto


class K8sApi(Choice):
    """Which Kubeflow resource carries a Kubernetes job."""

    trainjob = "trainjob"  # Kubeflow Trainer v2: trainer.kubeflow.org/v1alpha1 TrainJob
    pytorchjob = "pytorchjob"  # Training Operator v1: kubeflow.org/v1 PyTorchJob


@dataclass
class K8sConfig:
    """cluster=kubernetes: where the job runs and what its pods get."""

    api: K8sApi = K8sApi.trainjob
    namespace: str = "default"
    # Container image with dtlaunch installed (required).
    image: str = ""
    # PersistentVolumeClaim holding run directories and checkpoints (required: a pod's own disk is lost
    # with the pod). Mounted on every node at mount_path; the run directory is <mount_path>/<run name>.
    pvc: str = ""
    mount_path: str = "/mnt/dtlaunch"
    # The ClusterTrainingRuntime a TrainJob refers to.
    runtime: str = "torch-distributed"
    service_account: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    # Pod tolerations, as Kubernetes writes them: [{key: ..., operator: Exists, effect: NoSchedule}].
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Secret holding a hub token, NAME or NAME:KEY (key default HF_TOKEN): the pods' HF_TOKEN refers to it
    # (the value is never written into a manifest). Empty = the pods get no token.
    hf_token_secret: str = ""
    # Requests = limits per node, as Kubernetes quantities ("32", "256Gi"); empty = none.
    cpu: str = ""
    memory: str = ""
    # Job name; empty = the run name made DNS-safe (lowercase, '-' for other characters).
    job_name: str = ""
    # kubeconfig context for submit and status; empty = the current one (or in-cluster config).
    context: str = ""


@dataclass
class SkyConfig:
    """cluster=skypilot: what SkyPilot provisions and where the run directory lives."""

    # Accelerator name as SkyPilot spells it (H100, A100-80GB); empty = from the hardware profile.
    accelerator: str = ""
    cloud: str = ""
    use_spot: bool = False
    # Bucket mounted on every node at mount_path, holding run directories and checkpoints (required).
    bucket: str = ""
    # Bucket store (s3, gcs, azure, r2, ...); empty = SkyPilot's choice.
    store: str = ""
    mount_path: str = "/mnt/dtlaunch"
    # `sky jobs launch` (managed: recovered after preemption) or `sky launch` on a cluster of this name.
    managed: bool = True
    cluster_name: str = ""
    # Port of the rendezvous on the first node.
    rdzv_port: int = 29500
    # Restarts after a failure of the run itself; exit 75 (stopped at a checkpoint) always restarts.
    max_restarts_on_errors: int = 0
    image_id: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    kind: str = "local"
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str = ""
    account: str = ""
    qos: str = ""
    # Slurm time limits ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"; "" = the partition's).
    # time is the training job's alone; with training.eval_tasks the evaluation is a job of its own
    # (one node, one GPU, started only after training succeeded) whose limit is eval_time.
    time: str = "01:00:00"
    eval_time: str = "01:00:00"
    cpus_per_task: int = 0
    mem: str = ""
    # Extra `#SBATCH` options, e.g. ["--exclusive", "--constraint=h100"].
    sbatch_args: list[str] = field(default_factory=list)
    # Commands run before torchrun on each node (module load, venv activation).
    setup: list[str] = field(default_factory=list)
    # Seconds before the time limit at which Slurm signals the job to checkpoint.
    signal_before_s: int = 120
    k8s: K8sConfig = field(default_factory=K8sConfig)
    sky: SkyConfig = field(default_factory=SkyConfig)


@dataclass
class RunConfig:
    # Run name; empty = "<recipe>-<timestamp>".
    name: str = ""
    # Run directory; empty = <root>/<name>.
    dir: str = ""
    root: str = "runs"


@dataclass
class DebugConfig:
    # Fault injection for tests: kill `fail_rank` at step `fail_at_step` (first attempt only).
    fail_at_step: int = -1
    fail_rank: int = 0
    # How the injected failure happens: "raise" (a Python error), "sigkill" (the worker kills itself) or
    # "input" (an input error only the worker can find: exit 2 through the launcher).
    fail_mode: str = "raise"
    # `fail_rank` stops at this step (first attempt only) and sleeps until signalled, so that its peers'
    # collectives run into launch.timeout_s (tests the collective-timeout guard).
    hang_at_step: int = -1
    # Inject a NaN loss at these steps (tests the bad-step guard).
    nan_at_steps: list[int] = field(default_factory=list)
    # Sleep this long (s) inside a checkpoint save on rank 1 (tests kill-during-save).
    slow_save_s: float = 0.0
    # `fail_rank` waits at the start of this step (first attempt only) until it receives SIGTERM / SIGUSR1,
    # logging "holding at step N"; its peers wait for it in their next collective. Tests signal a run at
    # a known step this way instead of by timing. training.steps + 1: after the last step, before the final
    # checkpoint (fail_at_step and hang_at_step read it the same way).
    hold_at_step: int = -1
    # `fail_rank` sleeps this long (s) in every step (tests the slow-rank report).
    slow_step_s: float = 0.0
    # objective=grpo: read each rollout's completions from this JSONL instead of sampling them (tests: every
    # layout trains on the same tokens). Line k: rollout k's completions, a list of token-id lists over the
    # whole generation batch in global order (prompt position, then its G completions). With objective.tools
    # a row may be a list of turns (lists of ids): the first, then each continuation after the tool results
    # (the tools really run); a continuation a row does not record is generated.
    replay_completions: str = ""


@dataclass
class ProfilingConfig:
    """torch.profiler traces of chosen steps: RUN/profile/step-<n>/rank<r>.json.gz per rank (Perfetto or
    chrome://tracing), and a step-time breakdown per rank printed at the end (RUN/profile/summary.json).
    Only the profiled steps and their warm-up steps pay for it; with enabled=false the loop is unchanged."""

    enabled: bool = False
    # Steps to profile (each gets its own trace) ...
    steps: list[int] = field(default_factory=lambda: [3])
    # ... and every N-th step too (N, 2N, ...); 0: only `steps`.
    every: int = 0
    # Steps the profiler runs before a profiled step without keeping them: its start-up cost lands there.
    warmup: int = 1
    # GPU: the CUDA allocator's history over the profiled steps, RUN/profile/step-<n>/rank<r>.memory.pickle
    # (open at pytorch.org/memory_viz); CPU: the profiler's memory events in the trace.
    memory: bool = False


@dataclass
class PlanConfig:
    """Assumptions of the memory planner that no other section states."""

    # Routed tokens the busiest expert-parallel rank receives, over the balanced share (max / mean of
    # tokens per expert, as training logs it in moe_imbalance_max). Default: tiny CPU runs
    # (model=planner_moe, 20 steps) logged 1.13-1.22, median 1.18; rounded up.
    moe_imbalance: float = 1.25


@dataclass
class JobConfig:
    # The recipe this job came from (set by composition; informational).
    recipe: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


def section_type(hint: Any) -> Optional[type]:
    """The schema section an annotation names (X or Optional[X] of a dataclass X), or None for a value."""
    return next((c for c in (hint, *getattr(hint, "__args__", ())) if is_dataclass(c)), None)


def to_dict(cfg: JobConfig) -> dict:
    """Plain-dict view of a composed config (for hashing, JSON and workers)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
