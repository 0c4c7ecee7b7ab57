"""LoRA on an MoE model: the frozen routed experts (3-D GroupedExperts weights) are stored in the compute
dtype like the frozen linears (fp32 stays fp32), and the autocast forward and backward run with them
(the grouped GEMM and the per-expert loop) within bf16 rounding of the fp32-stored experts."""

from __future__ import annotations

import pytest
import torch

from dtlaunch.job.compose import compose
from dtlaunch.models.moe import experts as experts_mod
from dtlaunch.models.registry import model_spec
from dtlaunch.train.features.peft import apply_peft
from dtlaunch.train.parallel.frozen_base import convert_frozen_base
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _model(*overrides: str, convert: bool = True) -> tuple:
    cfg = compose(["model=tiny_moe", "peft=lora", "peft.targets=[wq,wk,wv,wo]", *overrides]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    apply_peft(model, cfg)
    if convert:
        convert_frozen_base(model, cfg, shards=1)
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    return cfg, model


def _routed(model: torch.nn.Module) -> list[torch.Tensor]:
    mods = [m for m in model.modules() if isinstance(m, experts_mod.GroupedExperts)]
    assert mods
    return [p for m in mods for p in (m.w1, m.w2, m.w3)]


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_frozen_routed_experts_stored_in_the_compute_dtype(precision: str, dtype: torch.dtype) -> None:
    _, model = _model(f"precision={precision}")
    routed = _routed(model)
    assert all(p.dtype == dtype and not p.requires_grad for p in routed)
    # The router's gate is a frozen linear: the compute dtype too; norm gains stay fp32.
    gates = [m.router.gate.weight for m in model.modules() if hasattr(m, "router")]
    assert gates and all(g.dtype == dtype for g in gates)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)


def test_full_training_keeps_fp32_experts() -> None:
    cfg = compose(["model=tiny_moe", "precision=bf16"]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device="meta")
    convert_frozen_base(model, cfg, shards=1)  # peft=none: nothing changes
    assert all(p.dtype == torch.float32 for p in _routed(model))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_bf16_experts_forward_backward_match_fp32_stored_under_autocast(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if grouped and torch.bfloat16 not in experts_mod.cpu_grouped_mm_dtypes():
        pytest.skip("torch._grouped_mm has no CPU bf16 kernel here")
    if not grouped:
        monkeypatch.setattr(experts_mod, "cpu_grouped_mm_dtypes", lambda: frozenset())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for convert in (True, False):
        cfg, model = _model("precision=bf16", "model.vocab_size=64", convert=convert)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().square().mean().backward()
        adapter = next(p for n, p in model.named_parameters() if n.endswith("lora_a"))
        out[convert] = (logits.float().detach(), adapter.grad.clone())
    # The autocast matmuls read a bf16 copy of the fp32-stored experts: the same values as bf16 storage
    # (the init is the same), so the two runs agree to bf16 accumulation-order noise.
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=5e-2, atol=1e-3)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_dpo_reference_copy_stores_routed_experts_in_the_compute_dtype(precision: str, dtype: torch.dtype) -> None:
    # The planner counts the frozen copy's linears and experts at the compute dtype (plan.objective.copy_bytes).
    from dtlaunch.train.objectives.reference import _frozen_model

    cfg = compose(["model=tiny_moe", "objective=dpo", "data.kind=synthetic", f"precision={precision}"]).cfg
    model, _, _ = _frozen_model(cfg, init=False)
    assert all(p.dtype == dtype and not p.requires_grad for p in _routed(model))
    assert model.tok_embeddings.weight.dtype == torch.float32  # as the policy's, trained in fp32
    assert all(m.weight.dtype == torch.float32 for n, m in model.named_modules() if n.endswith("norm"))
