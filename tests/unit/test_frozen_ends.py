"""LoRA's frozen embedding and head: stored in the compute dtype, FSDP2 units of their own (frozen_ends),
the residual stream fp32 without FSDP; optim.state_dtype=bf16 makes the adapters bf16."""

from __future__ import annotations

import torch

from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec
from dtlaunch.train.features.peft import apply_peft
from dtlaunch.train.parallel.frozen_base import convert_frozen_base, frozen_ends
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _model(*overrides: str) -> tuple:
    cfg = compose(["model=tiny", "peft=lora", "precision=bf16", *overrides]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    apply_peft(model, cfg)
    return cfg, model


def test_frozen_embedding_and_head_in_the_compute_dtype_adapters_fp32() -> None:
    cfg, model = _model()
    convert_frozen_base(model, cfg, shards=1)
    assert model.tok_embeddings.weight.dtype == model.output.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32
    assert frozen_ends(model) == [model.tok_embeddings, model.output]
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.tok_embeddings(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.float32


def test_bf16_state_makes_adapters_bf16_and_fsdp_keeps_the_embedding_output() -> None:
    cfg, model = _model("optim.state_dtype=bf16")
    convert_frozen_base(model, cfg, shards=2, fsdp=True)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert adapters and all(p.dtype == torch.bfloat16 and p.requires_grad for p in adapters)
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    assert model.tok_embeddings(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_full_training_has_no_frozen_ends() -> None:
    cfg = compose(["model=tiny"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    assert frozen_ends(model) == []
