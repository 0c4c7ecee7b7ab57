"""model.moe: one-line errors for bad settings, closed-form counts split for expert parallelism, active
FLOPs, and the planner on the published MoE sizes (all torch-free)."""

from __future__ import annotations

import pytest

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.models.flops import matmul_params
from dtlaunch.models.moe import shapes
from dtlaunch.models.shapes import param_count


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=tiny_moe", "model.moe.top_k=9"],
            r"model.moe.top_k=9 exceeds model.moe.num_experts=8: set model.moe.top_k <= 8",
        ),
        (
            ["model=tiny", "model.moe.num_experts=4"],
            r"model.moe.num_experts=4 with model.arch=llama, whose fields have no",
        ),
        (["model=tiny_moe", "model.moe.num_experts=0"], r"model.moe.num_experts=0: model.arch=moe is a mixture"),
        (["model=tiny_moe", "model.moe.dense_layers=[4]"], r"model.moe.dense_layers has 4, past the last block"),
        (
            ["model=mixtral_8x7b", "model.moe.score_func=sigmoid"],
            r"model.moe.score_func=sigmoid does not fit model.arch=mixtral",
        ),
        (["model=tiny_moe", "model.moe.aux_loss_coef=-1"], r"model.moe.aux_loss_coef=-1.0 is out of range"),
        (
            ["model=tiny_moe", "strategy=tp", "launch.nproc_per_node=2", "model.moe.expert_dim=33"],
            r"strategy.tp=2 does not divide model.moe.expert_dim=33 \(model.arch=moe\): choose a tp that divides it",
        ),
    ],
)
def test_bad_moe_settings_are_one_line_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose(overrides).cfg)
    assert "\n" not in str(err.value)


def test_counts_split_routed_experts_from_the_rest() -> None:
    m = compose(["model=tiny_moe", "model.moe.dense_layers=[0]", "model.moe.num_shared_experts=1"]).cfg.model
    per = [shapes.layer_params(m, i) for i in range(4)]
    assert per[0]["routed"] == 0 and per[1]["routed"] == 3 * 8 * 64 * 32
    assert param_count(m) == 2 * 512 * 64 + 64 + sum(p["routed"] + p["other"] for p in per)


def test_active_parameters_of_the_published_sizes() -> None:
    """Qwen3-30B-A3B activates 3.3B parameters per token, Mixtral-8x7B 12.9B (embedding included)."""
    q = compose(["model=qwen3_30b_a3b"]).cfg.model
    assert abs(matmul_params(q) + q.vocab_size * q.dim - 3.35e9) < 0.01e9
    mx = compose(["model=mixtral_8x7b"]).cfg.model
    assert abs(matmul_params(mx) + mx.vocab_size * mx.dim - 12.88e9) < 0.01e9


def test_plan_of_qwen3_30b_a3b() -> None:
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory

    job = load_job(["model=qwen3_30b_a3b", "strategy=fsdp", "launch.nproc_per_node=8", "hardware=h100_80gb"])
    plan = plan_memory(job.cfg, job.layout)
    # bf16-free default precision: fp32 parameters, grads and Adam state of 30.5B over 8 ranks.
    assert plan.stages[0].params == 30_532_122_624
    assert plan.stages[0].lines["optimizer state"] == pytest.approx(8 * 30_532_122_624 / 8)
