"""The planner's LoRA lines on the MoE family: the frozen routed experts in the compute dtype (no gradient,
no optimizer state), the adapters on attention, and the saved activations a frozen MoE block no longer
keeps, against the runtime's StorageCounter (a block's saved bytes, LoRA minus full training)."""

from __future__ import annotations

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.peft import peft_notes, peft_terms
from dtlaunch.train.features.peft import apply_peft
from dtlaunch.train.observe.memtrack import StorageCounter
from dtlaunch.train.parallel.frozen_base import convert_frozen_base
from dtlaunch.train.parallel.init_weights import materialize_and_init

MOE_LORA = ["model=planner_moe", "peft=lora", "peft.targets=[wq,wk,wv,wo]", "hardware=cpu"]
RUN = ["training.micro_batch=4", "training.seq_len=128", "strategy=zero3", "launch.nproc_per_node=2"]


def test_moe_lora_plan_counts_frozen_experts_in_bf16_and_only_the_adapters_train() -> None:
    job = load_job([*MOE_LORA, *RUN, "strategy.ep=2", "precision=bf16"])
    assert peft_notes(job.cfg) == []  # closed-form terms, not full training's upper bound
    lines = plan_memory(job.cfg, job.layout).worst.lines
    # planner_moe: h=256, 8 blocks, 8 heads / 4 KV heads of 32, 8 experts of width 256, vocab 2,048.
    attention = 2 * 256 * 256 + 2 * 128 * 256
    router, routed, norms = 8 * 256, 3 * 8 * 256 * 256, 2 * 256
    frozen = 8 * (attention + router + routed) + 2 * 2048 * 256  # + embedding and head
    fp32 = 8 * norms + 256
    # Sharded over both ranks (EP splits the experts, FSDP the rest: each rank holds half of every byte).
    assert lines["parameters"] == (4 * fp32 + 2 * frozen) / 2
    # rank-8 adapters: wq, wo (256 x 256), wk, wv (128 x 256): A [8, in] + B [out, 8].
    adapters = 8 * (2 * (8 * 256 + 256 * 8) + 2 * (8 * 256 + 128 * 8))
    assert lines["adapter parameters"] == 4 * adapters / 2
    assert lines["optimizer state"] == 8 * adapters / 2
    full = load_job(["model=planner_moe", "hardware=cpu", *RUN, "strategy.ep=2", "precision=bf16"])
    assert plan_memory(full.cfg, full.layout).worst.lines["parameters"] == 4 * (frozen + fp32) / 2


def _kept(layers: int, lora: bool, autocast: bool, extra: list[str]) -> int:
    over = ["model=planner_moe", f"model.n_layers={layers}", *extra] + (["precision=bf16"] if autocast else [])
    cfg = load_job(over + (MOE_LORA[1:3] if lora else [])).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=32, device="meta")
    if lora:
        apply_peft(model, cfg)
    convert_frozen_base(model, cfg, shards=1)
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    counter = StorageCounter()
    counter.add_existing([*model.parameters(), *model.buffers()])
    marks: list[int] = []
    model.layers["0"].register_forward_pre_hook(lambda *_: marks.append(counter.live))
    model.layers[str(layers - 1)].register_forward_hook(lambda *_: marks.append(counter.live))
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(torch.randint(0, cfg.model.vocab_size, (2, 32)))
    return marks[-1] - marks[0]


@pytest.mark.parametrize("shared", [[], ["model.moe.num_shared_experts=1"]], ids=["routed", "shared"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_frozen_moe_block_saves_what_the_planner_says(autocast: bool, shared: list[str]) -> None:
    tokens = 2 * 32
    # One block that is not the first (the first one's input needs no gradient: a term of its own).
    measured = {
        lora: (_kept(3, lora, autocast, shared) - _kept(2, lora, autocast, shared)) / tokens for lora in (False, True)
    }
    cfg = load_job([*MOE_LORA, *shared] + (["precision=bf16"] if autocast else [])).cfg
    e = 2 if autocast else 4
    ft = peft_terms(cfg, 1, 1, False, 1, e, autocast, rank_tokens=tokens)
    assert ft is not None
    planned = ft.act_block + ft.adapter_act
    if autocast:
        # The block's autocast weight copies (their own plan line): every matrix under full training, the
        # adapters' only under LoRA (the frozen base is stored in bf16).
        spec = model_spec(cfg.model)
        matrices = spec.block_params(cfg.model) - spec.block_norm_params(cfg.model)
        planned += e * (ft.adapters_block - matrices) / tokens
    assert measured[True] - measured[False] == pytest.approx(planned, abs=1e-6)
