"""Float8 (torchao) without processes: the validate rules of precision.float8 / float8_emulate, which linears
are converted, the float8 tensor-parallel styles, and the plan's float8 lines under TP.
Training under DDP, FSDP2 and TP against one process: tests/distributed/test_float8.py."""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError

F8 = ["precision=bf16", "precision.float8=tensorwise"]


@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            ["precision.float8_emulate=true"],
            "precision.float8_emulate=true emulates float8 matmuls, but precision.float8=none",
        ),
        ([*F8], "for tests only: no speed-up"),
        (
            [*F8, "precision.float8_emulate=true", "training.compile=true"],
            "runs eagerly only: set training.compile=false",
        ),
        (
            ["recipe=tiny_tp", *F8, "precision.float8_emulate=true"],
            "strategy.sequence_parallel=true all-gathers float8 activations, which gloo cannot",
        ),
    ],
)
def test_float8_options_are_one_line_errors(overrides: list[str], words: str) -> None:
    recipe = [] if overrides[0].startswith("recipe=") else ["recipe=tiny_ddp"]
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        load_job([*recipe, *overrides])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe=tiny_ddp", *F8, "precision.float8_emulate=true"],
        ["recipe=tiny_tp", *F8, "precision.float8_emulate=true", "strategy.sequence_parallel=false"],
        ["recipe=tiny_tp", "precision=bf16", "precision.float8=rowwise", "precision.float8_emulate=true"],
        ["recipe=llama70b_fsdp_tp", "precision.float8=tensorwise"],  # tensor parallel on Hopper, NCCL
    ],
)
def test_float8_emulated_on_cpu_and_with_tensor_parallel_is_accepted(overrides: list[str]) -> None:
    load_job(overrides)


def _converted_block(recipe: str, multiple_of: int):
    torchao = pytest.importorskip("torchao")
    import torch

    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.parallel.float8 import apply_float8

    over = ["model=tiny", f"model.multiple_of={multiple_of}", "precision=bf16", f"precision.float8={recipe}"]
    cfg = compose([*over, "precision.float8_emulate=true"]).cfg
    model = model_spec(cfg.model).build(cfg.model, device="meta")
    apply_float8(model, cfg.precision, torch.device("cpu"))
    linear = torchao.float8.float8_linear.Float8Linear
    return model, cfg, {n for n, m in model.named_modules() if isinstance(m, linear)}


def test_float8_converts_block_linears_with_dims_divisible_by_16_not_the_head() -> None:
    # multiple_of=20: the FFN is 180 wide, so w1/w2/w3 stay in bf16; attention's 64/32-wide ones convert.
    _, _, converted = _converted_block("tensorwise", multiple_of=20)
    assert converted == {f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")}
    _, _, converted = _converted_block("tensorwise", multiple_of=32)
    assert "output" not in converted and "layers.0.feed_forward.w2" in converted


def test_float8_tensor_parallel_styles() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from dtlaunch.models.dense import tp_plan
    from dtlaunch.train.parallel.tensor_parallel import torch_plan

    def block_plan(m, sp):
        return torch_plan(tp_plan.block_plan(m, sp))

    from dtlaunch.train.parallel.float8 import float8_tp_plan

    model, cfg, _ = _converted_block("tensorwise", multiple_of=20)
    styles = {k: type(v) for k, v in float8_tp_plan(block_plan(cfg.model, True), model.layers["0"]).items()}
    assert styles["attention.wq"] is Float8ColwiseParallel and styles["attention.wo"] is Float8RowwiseParallel
    assert styles["attention"] is PrepareFloat8ModuleInput  # q/k/v all float8: one float8 all-gather
    # The FFN stayed in bf16 (180 wide): plain styles, plain bf16 all-gather of its input.
    assert styles["feed_forward.w1"] is ColwiseParallel and styles["feed_forward"] is PrepareModuleInput
    model, cfg, _ = _converted_block("rowwise", multiple_of=32)  # rowwise: torch's styles, bf16 gathers
    plain = {k: type(v) for k, v in float8_tp_plan(block_plan(cfg.model, True), model.layers["0"]).items()}
    assert plain == {k: type(v) for k, v in block_plan(cfg.model, True).items()}


def test_float8_plan_lines_divide_by_tensor_parallel() -> None:
    from dtlaunch.plan.memory import plan_memory

    one = load_job(["recipe=llama8b_fsdp", "precision.float8=tensorwise"])
    two = load_job(["recipe=llama8b_fsdp", "precision.float8=tensorwise", "strategy.tp=2"])
    lines = [plan_memory(j.cfg, j.layout).worst.lines["float8 casts"] for j in (one, two)]
    assert lines[1] < lines[0]
