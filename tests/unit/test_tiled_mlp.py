"""Tiled MLP (dtlaunch/train/features/tiled_mlp.py) against the untiled model, one process, fp32: the loss and every
trained parameter's gradient within 1e-6 relative. Dense blocks, LoRA (with dropout: the recompute replays
the forward's masks), QLoRA's NF4 base, MoE blocks' shared and routed experts (the routed ones alone:
tests/unit/test_tiled_experts.py); and under full activation
checkpointing. The bad values of training.mlp_tiles are refused in one line."""

import copy
import functools

import pytest
import torch

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.models.registry import model_spec
from dtlaunch.train.features.peft import apply_peft
from dtlaunch.train.features.tiled_mlp import apply_tiled_mlp
from dtlaunch.train.parallel.ac import apply_ac
from dtlaunch.train.parallel.frozen_base import convert_frozen_base
from dtlaunch.train.parallel.init_weights import materialize_and_init

SEQ = 48


def _model(overrides: list[str]) -> tuple:
    cfg = compose(["model=tiny", f"training.seq_len={SEQ}", *overrides]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=SEQ, device="meta")
    apply_peft(model, cfg)
    convert_frozen_base(model, cfg, shards=1)
    materialize_and_init(model, torch.device("cpu"), 0, init_source=model)
    return cfg, model


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple:
    torch.manual_seed(3)  # LoRA dropout draws the same masks in both models
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


CASES = {
    "dense": [],
    "lora": ["peft=lora", "peft.targets=[q_proj,v_proj,gate_proj,up_proj,down_proj]"],
    "moe_shared": ["model=tiny_moe", "model.moe.num_shared_experts=1"],
}


@pytest.mark.parametrize("name", [*CASES, "dense_full_ac", "qlora"])
def test_tiled_matches_untiled(name: str) -> None:
    if name == "qlora":
        pytest.importorskip("torchao")
        overrides = [
            "peft=qlora",
            "peft.nf4_block_size=16",
            "peft.nf4_scaler_block_size=4",
            "peft.targets=[q_proj,v_proj,gate_proj,up_proj,down_proj]",
        ]
    else:
        overrides = CASES.get(name, [])
    cfg, plain = _model(overrides)
    _, tiled = _model(overrides)  # the same seeded init (a deep copy would re-quantise NF4 with defaults)
    # One MLP per block; a MoE block's routed experts too. Uneven tiles: 48 = 10+10+10+9+9.
    moe = sum(type(m).__name__ == "GroupedExperts" for m in tiled.modules())
    assert apply_tiled_mlp(tiled, 5) == int(cfg.model.n_layers) + moe and moe == (4 if name == "moe_shared" else 0)
    if name == "dense_full_ac":
        cfg.training.activation_checkpointing = "full"
        apply_ac(plain, cfg.training)
        apply_ac(tiled, cfg.training)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(plain, tokens)
    tloss, tgrads = _loss_and_grads(tiled, tokens)
    assert torch.allclose(tloss, loss, rtol=1e-6, atol=0)
    assert grads.keys() == tgrads.keys() and grads
    for n, g in grads.items():
        # Relative to the gradient's norm: a weight gradient sums over tokens, and tiles sum in another
        # order (fp32 rounding of single elements near zero is relatively larger).
        assert (tgrads[n] - g).norm() <= 1e-6 * g.norm(), (n, ((tgrads[n] - g).norm() / g.norm()).item())


def test_recompute_replays_lora_dropout() -> None:
    """With LoRA dropout each tile draws its own masks: the backward's recompute must draw the same ones.
    Reference: the same tiles run with plain autograd (no recompute), so the same random stream."""
    cfg, plain = _model(["peft=lora", "peft.dropout=0.3", "peft.targets=[gate_proj,up_proj,down_proj]"])
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, 4)
    for mod in plain.modules():
        if type(mod).__name__ == "FeedForward":
            mod.forward = functools.partial(_tiles_with_autograd, mod)
    plain.train(), tiled.train()
    tokens = torch.randint(0, int(cfg.model.vocab_size), (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(plain, tokens)
    tloss, tgrads = _loss_and_grads(tiled, tokens)
    assert torch.allclose(tloss, loss, rtol=1e-6, atol=0)
    for n, g in grads.items():
        assert (tgrads[n] - g).norm() <= 1e-6 * g.norm(), n


def _tiles_with_autograd(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([type(mlp).forward(mlp, t) for t in x.tensor_split(4, dim=-2)], dim=-2)


def test_no_grad_forward_is_the_untiled_one() -> None:
    _, plain = _model([])
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, 3)
    tokens = torch.randint(0, 256, (1, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(tiled(tokens), plain(tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["training.mlp_tiles=-1"], "training.mlp_tiles"),
        (["recipe=tiny_tp", "training.mlp_tiles=4", "strategy.sequence_parallel=true"], "sequence_parallel"),
    ],
)
def test_bad_mlp_tiles_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        load_job(overrides)
    assert "\n" not in str(err.value)


def test_maximize_turns_tiles_on_and_fits_more() -> None:
    """`plan --maximize training.seq_len` with training.mlp_tiles=0 lets the plan tile, says so, and fits
    more than untiled (8B QLoRA, 24 GB, activation offload: 103,473 tokens against 52,853 planned untiled)."""
    from dtlaunch.plan.maximize import maximize

    base = [
        "recipe=llama3_8b_qlora",
        "training.micro_batch=1",
        "training.global_batch=1",
        "model.max_seq_len=400000",
        "training.activation_offload=true",
        "training.compile=false",
        "hardware.host_memory_gib=64",
    ]
    tiled = maximize(load_job(base).cfg, "training.seq_len")
    untiled = maximize(load_job([*base, "training.mlp_tiles=1"]).cfg, "training.seq_len")
    assert untiled.savers == () and tiled.savers == (f"training.mlp_tiles={-(-tiled.value // 8192)}",)
    assert tiled.value > 1.5 * untiled.value


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, seq, ac, extra",
    # Dense with full AC at 2 blocks instead of 8: the peak is one recomputed block's tiled MLP either way,
    # and with less of the rest the tiled term is a larger share of the peak (plan -1.6 % against -1.3 % at
    # 8 blocks; 95 MiB planned tiled, 147 MiB untiled), at 19 s instead of 46 s at load 3 (issue #49).
    # MoE without AC: the routed experts' saved intermediates and tiles are what change (plan +0.4 %;
    # untiled 558 MiB planned, tiled 439 MiB).
    [("planner7m", 4096, "full", ["model.n_layers=2"]), ("planner_moe", 2048, "none", [])],
    ids=["planner7m-2l-4096-full", "planner_moe-2048-none"],
)
def test_plan_within_8_percent_of_trace_tiled(model: str, seq: int, ac: str, extra: list[str]) -> None:
    """The plan's tiled terms (dtlaunch.plan.tiled_terms) against the traced step on real CPU tensors."""
    from dtlaunch.plan.trace import trace_peak

    job = load_job(
        [
            f"model={model}",
            f"model.max_seq_len={seq}",
            "hardware=cpu",
            "training.micro_batch=1",
            f"training.seq_len={seq}",
            f"training.activation_checkpointing={ac}",
            "training.mlp_tiles=8",
            *extra,
        ]
    )
    from dtlaunch.plan.memory import plan_memory

    predicted = plan_memory(job.cfg, job.layout).stages[0].peak
    traced = trace_peak(job.cfg, job.layout, fake=False)["peak_bytes"]
    assert abs(predicted - traced) / traced <= 0.08, (predicted, traced)
