"""The planner's fine-tuning terms against the real modules: adapter counts against the LoRA linears a
meta model gets, NF4 bytes against torchao's tensors, and the lines a LoRA / QLoRA plan shows."""

from __future__ import annotations

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.peft import nf4_bytes, peft_terms
from dtlaunch.plan.search import candidates, search

TINY = ["model=tiny", "training.seq_len=32", "training.micro_batch=2", "precision=bf16"]
SMALL_NF4 = ["peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4"]


def inner_bytes(t: torch.Tensor) -> int:
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block,scaler", [((64, 32), 16, 8), ((256, 256), 64, 256), ((512, 128), 32, 4)])
def test_planned_nf4_bytes_are_torchaos_real_bytes(dtype: torch.dtype, shape: tuple, block: int, scaler: int) -> None:
    torchao_nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    t = torchao_nf4.to_nf4(torch.randn(*shape, dtype=dtype), block, scaler)
    assert nf4_bytes(shape[0] * shape[1], block, scaler, dtype.itemsize) == inner_bytes(t)


@pytest.mark.parametrize("targets,rank", [(None, 8), ("[all-linear]", 4), ("[q_proj,down_proj]", 16)])
def test_planned_adapter_count_is_the_lora_models(targets: str | None, rank: int) -> None:
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.features.peft import apply_peft

    over = [*TINY, "peft=lora", f"peft.rank={rank}"] + ([f"peft.targets={targets}"] if targets else [])
    cfg = load_job(over).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=32, device="meta")
    apply_peft(model, cfg)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ft = peft_terms(cfg, int(cfg.model.n_layers), 1, False, 1, 2, False, rank_tokens=32.0)
    assert ft is not None and ft.adapters == trained > 0


def test_qlora_plan_counts_the_real_nf4_bytes_and_no_base_gradients() -> None:
    pytest.importorskip("torchao")
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.features.peft import apply_peft
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    job = load_job([*TINY, "peft=qlora", *SMALL_NF4, "strategy=ddp", "launch.nproc_per_node=1"])
    cfg = job.cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=32, device="cpu")
    apply_peft(model, cfg)
    convert_frozen_base(model, cfg, shards=1)  # quantises the real (CPU) weights with torchao
    from dtlaunch.models.nf4 import is_nf4

    real_nf4 = sum(inner_bytes(p) for p in model.parameters() if is_nf4(p))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines = plan_memory(cfg, job.layout).worst.lines
    assert lines["NF4 base weights"] == real_nf4 > 0
    assert lines["adapter parameters"] == 4 * adapters
    assert lines["optimizer state"] == 8 * adapters  # AdamW's two moments of the adapters only


def test_lora_plan_is_below_full_training_and_frozen_base_has_no_optimizer_bytes() -> None:
    full = load_job([*TINY, "strategy=zero3", "launch.nproc_per_node=2"])
    lora = load_job([*TINY, "peft=lora", "strategy=zero3", "launch.nproc_per_node=2"])
    pf, pl = plan_memory(full.cfg, full.layout), plan_memory(lora.cfg, lora.layout)
    assert pl.peak < pf.peak
    ft = peft_terms(lora.cfg, int(lora.cfg.model.n_layers), 1, False, 2, 2, False, rank_tokens=32.0)
    assert ft is not None
    assert (
        plan_memory(lora.cfg, lora.layout).to_dict()["stages"][0]["phases"]["optimizer"] < pf.worst.phases["optimizer"]
    )
    assert "LoRA activations" in pl.worst.lines or pl.worst.phase == "optimizer"


def test_search_keeps_qlora_on_layouts_that_hold_nf4() -> None:
    # The tiny model: tensor parallel and pipelines are candidates for LoRA, never for QLoRA; FSDP over 4
    # ranks cuts its 64x64 projections into 1,024-element shards, which hold 16 x 4 NF4 blocks.
    lora = load_job([*TINY, "peft=lora", "launch.nproc_per_node=4", "training.global_batch=8"])
    qlora = load_job([*TINY, "peft=qlora", *SMALL_NF4, "launch.nproc_per_node=4", "training.global_batch=8"])
    assert any(lay.tp > 1 or lay.pp > 1 for lay, _, _ in candidates(lora.cfg))
    layouts = [lay for lay, _, _ in candidates(qlora.cfg)]
    assert layouts and all(lay.tp == lay.pp == 1 for lay in layouts)
    assert any(st["zero_stage"] == 3 and lay.dp_shard == 4 for lay, st, _ in candidates(qlora.cfg))
    assert search(qlora.cfg, top=3)


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_frozen_head_is_a_unit_of_its_own_under_the_chunked_loss(zero: str) -> None:
    """The chunked loss runs inside the frozen head's own FSDP unit (dtlaunch.train.loss): the
    head is no longer held with the root unit (the static lines are those of the full-vocabulary loss,
    whose head was always a unit of its own), only during the loss (its backward moment has it)."""
    from dtlaunch.plan.loss_terms import loss_backward_bytes
    from dtlaunch.plan.stage import stage_shape, static_lines

    def shape(chunks: int):
        job = load_job(
            [*TINY, "peft=lora", f"strategy={zero}", "launch.nproc_per_node=2", f"training.loss_chunks={chunks}"]
        )
        return stage_shape(job.cfg, job.layout, 0, int(job.cfg.model.n_layers), True, True)

    chunked, full = shape(8), shape(1)
    assert chunked.frozen_head_unit and full.frozen_head_unit
    assert static_lines(chunked)["unsharded parameters"] == static_lines(full)["unsharded parameters"]
    # One chunk's fp32 logits (and, in bf16, the matmul's output or the gradient's cast) of the fused loss.
    e = chunked.compute_bytes
    at_chunk = (4 + (e if e != 4 else 0)) * chunked.block_dims.vocab * -(-chunked.tokens // 8)
    assert (
        loss_backward_bytes(chunked) == at_chunk + 2 * e * chunked.vocab_params
    )  # the gathered head, and its all-gather output


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["peft=lora", "strategy=zero2"],
        ["peft=lora", "strategy=zero3", "precision=bf16"],
        ["peft=qlora", "peft.nf4_scaler_block_size=128", "strategy=zero3"],
    ],
)
def test_head_unit_plan_within_5_percent_of_trace(overrides: list[str]) -> None:
    """The planner against the traced CPU run (`dtlaunch plan --trace`, real tensors, torch's
    FSDPMemTracker following the head's unit through the chunked loss) with 8 loss chunks."""
    from dtlaunch.plan.trace import trace_peak

    base = ["model=planner7m", "training.micro_batch=4", "training.seq_len=128", "hardware=cpu"]
    job = load_job([*base, *overrides, "launch.nproc_per_node=2", "training.loss_chunks=8"])
    traced = trace_peak(job.cfg, job.layout, rank=0)
    predicted = plan_memory(job.cfg, job.layout).peak
    assert abs(predicted - traced["peak_bytes"]) / traced["peak_bytes"] <= 0.05, (predicted, traced)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_reward_model_plan_trains_the_score_head_beside_the_adapters(method: str) -> None:
    """objective=reward with LoRA / QLoRA: the score head trains in full (dtlaunch.models.score_head), so the
    planner's trained parameters (gradients, AdamW state) are the model's adapters plus the head, and its
    parameter lines hold what the converted model stores (no LM head; the head and norms in fp32)."""
    from dtlaunch.models.registry import model_spec
    from dtlaunch.models.score_head import add_score_head
    from dtlaunch.plan.stage import stage_shape, static_lines
    from dtlaunch.train.features.peft import apply_peft
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    job = load_job([*TINY, "objective=reward", f"peft={method}", *SMALL_NF4, "strategy=ddp", "launch.nproc_per_node=1"])
    cfg = job.cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=32, device="meta")
    apply_peft(model, cfg, add_score_head(model))
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained.pop("score.weight") == int(cfg.model.dim) and trained
    shape = stage_shape(cfg, job.layout, 0, int(cfg.model.n_layers), True, True)
    assert shape.trained_params == sum(trained.values()) + int(cfg.model.dim)
    lines = static_lines(shape)
    assert lines["optimizer state"] == 8 * shape.trained_params  # fp32 AdamW moments
    if method == "lora":
        convert_frozen_base(model, cfg, shards=1)
        real = sum(p.numel() * p.element_size() for p in model.parameters())
        assert lines["parameters"] + lines["adapter parameters"] == real
