"""The memory planner's fine-tuning terms (peft.method=lora / qlora; pure Python, never imports torch).

What changes against full training, per rank (dtlaunch.plan.stage.plan_stage applies it):
- the frozen linears are stored in the compute dtype (dtlaunch.train.parallel.frozen_base): no fp32 master, and
  under autocast no saved cast of them (the cast is the weight itself);
- only the adapters train: gradients, AdamW state, DDP buckets and the optimizer's temporaries count
  the adapters (`lora_a` [rank, in], `lora_b` [out, rank] per adapted linear, split by tensor parallel
  as dtlaunch.train.parallel.lora_tp does); the frozen base has none, the head and embedding no gradient;
- QLoRA's block linears are NF4 (torchao): their real bytes, codes n/2 + int8 block scales + one
  factor per scaler block in the compute dtype + mean and code table, per tensor and per FSDP shard.
  FSDP gathers those bytes, not a compute-dtype copy; a matmul dequantises the weight on the fly:
  torchao's `get_original_weight` holds two int64 code tensors, the dequantised halves, their scales
  and the result at once, (8 + 3e) bytes per element of the largest linear (measured on CPU). It saves
  the NF4 weight itself for backward, never an autocast copy;
- saved activations (per token, one block; measured with saved-tensor hooks on the dense block, fp32,
  bf16 params and autocast): the norms keep what they keep in full training (their input and rsqrt;
  dtlaunch.models.dense.norm); each adapter keeps its rank-wide A output (+e·rank); under
  autocast a frozen linear without an adapter no longer saves its own cast of a norm output (-e·in);
  a dropout > 0 keeps its mask and dropped input (+(1 + e)·in). The first block's input does not need
  a gradient (the embedding is frozen), so its first norm saves nothing of its own (-(e_n·h + 4), e_n
  the stream's dtype: 4 under autocast); the final norm before the frozen head keeps only its input
  and rsqrt (e_n·h + 4). Under selective
  AC's op policy (every other matmul's output saved) the adapters' matmuls join the alternation, which
  then keeps other outputs: counted from the call order (measured on real runs: exact).

MoE (model families with routed experts): the routed experts are frozen 3-D parameters stored in the
compute dtype (counted with the frozen base, sharded by EP then FSDP as full training shards them; never
adapted, no gradient or optimizer state). Per sparse block and token they no longer save (measured with
the runtime's StorageCounter on planner_moe blocks, fp32, bf16 params and autocast, grouped GEMM and the
per-expert loop: exact) the grouped token copies and the SwiGLU product their weights' gradients read,
routed_scale·k·e·(h + F); the FFN norm's output (or, under autocast, each frozen reader's cast of it)
when neither the router's gate nor a shared expert reading it is adapted, e·h; a frozen shared down
projection's input, e·F_shared.

Shapes come from the model family (`ModelSpec.block_linears`: target name -> (out, in, column-parallel;
None: whole on every TP rank)); a family without them is planned as full training, with a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtlaunch.plan.lines import Line

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

ALL_LINEAR = "all-linear"
# Linears that read the same norm output (autocast: each saves its own cast of it); wq/wk/wv: model.arch=moe's
# names (no Hugging Face format).
NORM_READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv")
# The attention linears of a block, by either name: an MoE block's FFN linears follow them.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "wq", "wk", "wv", "wo")
NF4_CODE_TABLE = 16
# Dequantising one NF4 weight for its matmul (torchao's get_original_weight) holds two int64 code tensors
# (8 bytes per element) and compute-dtype tensors (the dequantised halves with their scales, the result)
# at once (measured on CPU).
# Measured by tests/unit/test_plan_peft.py::test_head_unit_plan_within_5_percent_of_trace
NF4_DEQUANT_CODE_BYTES = 8
# The compute-dtype tensors it holds at the same time.
# Measured by tests/unit/test_plan_peft.py::test_head_unit_plan_within_5_percent_of_trace
NF4_DEQUANT_COMPUTE_COPIES = 3


def nf4_bytes(numel: int, block_size: int, scaler_block_size: int, dtype_bytes: int) -> int:
    """Bytes of one torchao NF4 tensor of `numel` elements: 4-bit codes (two a byte), one int8 scale per
    block, one factor per scaler block in the tensor's dtype, the scales' mean and the 16-entry code
    table (both in that dtype)."""
    n_blocks = numel // block_size
    return numel // 2 + n_blocks + (n_blocks // scaler_block_size) * dtype_bytes + (1 + NF4_CODE_TABLE) * dtype_bytes


@dataclass(frozen=True)
class PeftTerms:
    """One rank's fine-tuning quantities for a stage of `layers` blocks (tensor-parallel rank shapes)."""

    method: str
    adapters: int  # adapter parameters of the stage on one TP rank (what trains)
    adapters_block: int
    quantised_block: int  # parameters of one block stored in NF4 (0 under LoRA)
    nf4_block: float  # their bytes, whole (what FSDP gathers per block), 0 under LoRA
    nf4_block_shard: float  # their bytes on one FSDP rank
    act_block: float  # saved bytes per token of one block the frozen base no longer keeps (<= 0)
    adapter_act: float  # saved bytes per token of one block's adapters (A outputs, dropout)
    act_first: float  # the first block, on top (frozen embedding: its input needs no gradient)
    final_norm: float  # saved bytes per token of the final norm before the frozen head
    dequant: float  # transient bytes of dequantising the largest NF4 linear once
    selective: float  # selective AC (op policy): saved matmul outputs per token, against full training

    @property
    def qlora(self) -> bool:
        return self.method == "qlora"


def linears(cfg: JobConfig) -> dict[str, tuple[int, int, bool]] | None:
    """One block's linears from the model family; None when the family does not give them."""
    from dtlaunch.models.registry import model_spec

    spec = model_spec(cfg.model)
    return None if spec.block_linears is None else dict(spec.block_linears(cfg.model))


def peft_notes(cfg: JobConfig) -> list[str]:
    """The plan's note for a fine-tuning run of a family without closed-form fine-tuning terms."""
    method = str(cfg.peft.method)
    if method == "none" or linears(cfg) is not None:
        return []
    return [
        f"peft.method={method}: no closed-form fine-tuning terms for model.arch={cfg.model.arch}; planned as full "
        "training (an upper bound: the base's gradients and optimizer state are counted)"
    ]


def adapted(cfg: JobConfig, names: list[str]) -> list[str]:
    from dtlaunch.models.registry import model_spec

    targets = model_spec(cfg.model).lora_targets(cfg.peft.targets)
    return list(names) if ALL_LINEAR in targets else [n for n in names if n in targets]


def adapter_params(out: int, inp: int, colwise: bool | None, rank: int, tp: int) -> int:
    """lora_a [rank, in] and lora_b [out, rank] on one TP rank: column-parallel shards B's rows (A
    whole), row-parallel shards A's columns (B whole), a linear TP leaves whole (None) neither."""
    if colwise is None:
        return rank * (inp + out)
    return rank * inp + out * rank // tp if colwise else rank * inp // tp + out * rank


def peft_terms(
    cfg: JobConfig,
    layers: int,
    tp: int,
    sp: bool,
    shards: int,
    e: int,
    autocast: bool,
    routed_scale: float = 1.0,
    ep: int = 1,
    *,
    rank_tokens: float,
) -> PeftTerms | None:
    """The fine-tuning terms of a stage; None for full training. `shards`: FSDP shard count (1 without);
    `routed_scale`: an MoE rank's routed token copies over the balanced share (expert parallel);
    `rank_tokens`: the tokens of one rank's micro-batch (its rows x the sequence over context parallel)."""
    p = cfg.peft
    method = str(p.method)
    if method == "none":
        return None
    shapes = linears(cfg)
    if shapes is None:
        return None  # planned as full training, with a note (peft_notes)
    chosen = adapted(cfg, list(shapes))
    rank = int(p.rank)
    h = int(cfg.model.dim)
    adapters_block = sum(adapter_params(*shapes[n], rank, tp) for n in chosen)
    expert_adapters, merged_experts = expert_adapter_terms(cfg, ep)
    adapters_block += expert_adapters
    quantised = nf4_whole = nf4_shard = dequant = 0.0
    if method == "qlora":
        b, s = int(p.nf4_block_size), int(p.nf4_scaler_block_size)
        sizes = [o * i for o, i, _ in shapes.values()]
        quantised = sum(sizes)
        nf4_whole = sum(nf4_bytes(n, b, s, e) for n in sizes)
        nf4_shard = sum(nf4_bytes(n // shards, b, s, e) for n in sizes)
        dequant = (NF4_DEQUANT_CODE_BYTES + NF4_DEQUANT_COMPUTE_COPIES * e) * max(sizes)
    sp_div = tp if tp > 1 and sp else 1
    stream = 4 if autocast else e  # the residual stream's bytes per element, what the norms keep
    act = 0.0
    adapter_act = e * rank * len(chosen)
    if float(p.dropout) > 0:
        adapter_act += sum((1 + e) * shapes[n][1] / (tp if shapes[n][2] is False else 1) for n in chosen)
    if autocast:
        act -= sum(e * shapes[n][1] for n in NORM_READERS if n in shapes and n not in chosen)
    if "down_proj" in shapes and "down_proj" not in chosen:
        act -= e * shapes["down_proj"][1] / tp  # w2's input, the SwiGLU product, is saved only by w2
    act += frozen_experts_act(cfg, shapes, chosen, e, autocast, routed_scale, tp)
    if merged_experts:
        # The merged expert weights each adapted block's grouped matmuls keep for backward: a block's
        # constant, spread over the tokens of one rank's micro-batch (the unit of this term).
        act += e * merged_experts / rank_tokens
    return PeftTerms(
        method=method,
        adapters=adapters_block * layers,
        adapters_block=adapters_block,
        quantised_block=int(quantised),
        nf4_block=nf4_whole,
        nf4_block_shard=nf4_shard,
        act_block=act,
        adapter_act=adapter_act,
        act_first=-(stream * h + 4) / sp_div,
        final_norm=(stream * h + 4) / sp_div,
        dequant=dequant,
        selective=saved_matmuls(shapes, chosen, rank, tp, sp, e) - saved_matmuls(shapes, [], rank, tp, sp, e),
    )


def expert_adapter_terms(cfg: JobConfig, ep: int = 1) -> tuple[int, int]:
    """peft.target_experts (dtlaunch.models.moe.experts.GroupedExperts.local_weights): the mean block's adapter
    parameters on the expert stacks (gate_up's A [E, r, h] and B [E, 2F, r], down's A [E, r, F] and B
    [E, h, r]) and its merged expert weights' elements (w1, w3, w2 plus their updates, kept by the grouped
    matmuls for backward), of this rank's experts (expert parallel: E / ep); (0, 0) without."""
    if not bool(getattr(cfg.peft, "target_experts", False)):
        return 0, 0
    from dtlaunch.models.moe.shapes import expert_dim, sparse_layers

    m = cfg.model
    h, f, r = int(m.dim), expert_dim(m), int(cfg.peft.rank)
    share = len(sparse_layers(m)) / int(m.n_layers)
    experts = int(m.moe.num_experts)
    params = round(share * experts * r * (2 * h + 3 * f))
    merged = round(share * experts // max(1, ep) * 3 * f * h)
    return params, merged


def frozen_experts_act(
    cfg: JobConfig,
    shapes: dict[str, tuple[int, int, bool | None]],
    chosen: list[str],
    e: int,
    autocast: bool,
    scale: float,
    tp: int = 1,
) -> float:
    """Saved bytes per token of a stage's mean block that an MoE block's frozen FFN no longer keeps (<= 0;
    0 for a model without routed experts): see the module docstring. `shapes` lists the FFN linears after
    the attention's: the router's gate, then the shared SwiGLU's gate, up and down."""
    from dtlaunch.models.registry import routed_experts

    m = cfg.model
    if not routed_experts(m):
        return 0.0
    from dtlaunch.models.moe.shapes import expert_dim, sparse_layers

    h, k = int(m.dim), int(m.moe.top_k)
    ffn = [n for n in shapes if n not in ATTENTION]
    readers, down = ffn[:3], ffn[3:]  # gate (+ shared gate, up) read the FFN norm's output
    # The grouped copies (their gate / up matmuls' input) and the SwiGLU product (down's input) are kept for
    # the weights' gradients only: adapted experts (peft.target_experts) keep them, as full training does.
    adapted = bool(getattr(cfg.peft, "target_experts", False))
    act = 0.0 if adapted else -scale * k * e * (h + expert_dim(m) / tp)  # TP: a rank's slice of each expert
    if autocast:
        act -= e * h * sum(n not in chosen for n in readers)
    elif not any(n in chosen for n in readers):
        act -= e * h
    act -= sum(e * shapes[n][1] / tp for n in down if n not in chosen)  # the shared down_proj: row-parallel
    return act * len(sparse_layers(m)) / int(m.n_layers)


def saved_matmuls(
    shapes: dict[str, tuple[int, int, bool]], chosen: list[str], rank: int, tp: int, sp: bool, e: int
) -> float:
    """Bytes per token of the matmul outputs selective AC's op policy saves in one block: the 1st, 3rd,
    ... matmul in call order (dtlaunch.train.parallel.ac), where an adapted linear calls three (base, A, B) and
    `shapes` is in forward order. Column-parallel outputs are sharded by TP, row-parallel ones (partial
    sums) only under sequence parallel; A's rank-wide output is whole on every TP rank."""
    outs: list[float] = []
    for name, (out, _inp, colwise) in shapes.items():
        width = out if colwise is None else out / tp if colwise else out / (tp if tp > 1 and sp else 1)
        outs.append(width)
        if name in chosen:
            outs += [rank, out / tp if colwise else out]
    return e * sum(outs[0::2])


def param_lines(
    ft: PeftTerms, p_rank: int, frozen: int, layers: int, shards: int, e: int, adapter_bytes: int = 4
) -> dict[str, float]:
    """The parameter lines of a fine-tuning stage (replacing full training's "parameters"): the frozen
    matrices (`frozen` parameters: the blocks' linears, the head's and the embedding's) in the compute
    dtype, the norm gains in fp32, the adapters in fp32 (bf16 with optim.state_dtype=bf16), QLoRA's
    block linears in NF4 instead."""
    quantised = ft.quantised_block * layers
    lines = {
        Line.PARAMETERS: (4 * (p_rank - frozen) + e * (frozen - quantised)) / shards,
        Line.ADAPTER_PARAMETERS: adapter_bytes * ft.adapters / shards,
    }
    if ft.qlora:
        lines[Line.NF4_BASE_WEIGHTS] = layers * (ft.nf4_block_shard if shards > 1 else ft.nf4_block)
    return lines


def gathered_block(ft: PeftTerms, blk: float, e: int) -> float:
    """Bytes of one block's parameters gathered by FSDP: the base in the compute dtype (QLoRA: its NF4
    bytes for the quantised linears) and the adapters in the compute dtype."""
    if ft.qlora:
        return e * (blk - ft.quantised_block) + ft.nf4_block + e * ft.adapters_block
    return e * (blk + ft.adapters_block)


def qlora_layout_ok(cfg: JobConfig, tp: int, pp: int, dp: int, replicas: int) -> bool:
    """Whether a searched layout can run QLoRA (dtlaunch.job.rules.qlora): no tensor or pipeline
    parallel, and every block linear's FSDP row shard holds whole NF4 blocks. Other methods: always."""
    if str(cfg.peft.method) != "qlora":
        return True
    if tp > 1 or pp > 1:
        return False
    shards = dp // replicas if replicas > 1 and dp // replicas > 1 else dp
    b, s = int(cfg.peft.nf4_block_size), int(cfg.peft.nf4_scaler_block_size)
    for out, inp, _ in (linears(cfg) or {}).values():
        n = out // shards * inp
        if out % shards or n % b or (n // b) % s:
            return False
    return True
