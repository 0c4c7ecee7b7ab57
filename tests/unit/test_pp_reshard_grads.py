"""`strategy.pp_reshard_grads`: FSDP's gradient policy across pipeline micro-batches, in the config, the
planner and the runtime's pipeline stage (dtlaunch.train.parallel.pipeline).

Loss parity of both policies with one process: tests/distributed/test_parallel_layouts.py (fsdp_pp_reshard_2x2),
and tests/e2e/test_train_tp_pp.py (the 3-D recipe, for the default). Predicted vs measured peaks of both: bench/planner_accuracy.py --real.
"""

from __future__ import annotations

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError
from dtlaunch.plan.memory import plan_memory

PP_FSDP = ["recipe=llama8b_fsdp", "strategy.pp=4", "strategy.pp_microbatches=4", "training.micro_batch=4"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["recipe=tiny_fsdp"], "pp=1"),
        (["recipe=tiny_pp", "launch.nproc_per_node=4", "strategy.pp=2", "strategy.dp_shard=2"], "zero_stage=0"),
        (
            [
                "recipe=tiny_pp",
                "model=tiny_deep",
                "strategy.pp_schedule=zbv",
                "strategy.pp_stages_per_rank=2",
                "launch.nproc_per_node=4",
                "strategy.pp=2",
                "strategy.dp_shard=2",
                "strategy.zero_stage=3",
            ],
            "pp_schedule=zbv",
        ),
    ],
    ids=["no-pipeline", "ddp", "split-backward"],
)
def test_refused_where_it_would_do_nothing_or_break(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match="strategy.pp_reshard_grads=true") as err:
        load_job([*overrides, "strategy.pp_reshard_grads=true"])
    assert expected in str(err.value)


def test_plan_keeps_less_and_communicates_more_when_resharding() -> None:
    from dtlaunch.plan.search import step_time
    from dtlaunch.plan.suggest import suggest

    keep, reshard = load_job(PP_FSDP), load_job([*PP_FSDP, "strategy.pp_reshard_grads=true"])
    keep_plan, reshard_plan = plan_memory(keep.cfg, keep.layout), plan_memory(reshard.cfg, reshard.layout)
    # Every stage: the whole stage's unsharded gradients are what resharding saves.
    for k, r in zip(keep_plan.stages, reshard_plan.stages, strict=True):
        assert r.peak < k.peak, (k.stage, r.peak, k.peak)
    assert any("pp_reshard_grads=true" in note for note in keep_plan.notes), keep_plan.notes
    n_mb = 4
    comm = [step_time(j.cfg, j.layout, 1, n_mb)["comm"] for j in (keep, reshard)]
    assert comm[1] > comm[0]
    # Between the two peaks, resharding is the cheapest fix the planner offers.
    between = (keep_plan.device_total + reshard_plan.device_total) / 2 / 2**30
    tight = load_job([*PP_FSDP, f"hardware.memory_gib={between:.2f}"])
    assert not plan_memory(tight.cfg, tight.layout).fits
    assert suggest(tight.cfg, tight.layout)[0]["overrides"] == ["strategy.pp_reshard_grads=true"]


def test_stage_reduce_scatters_after_every_micro_batch(tmp_path) -> None:
    """The runtime does what the plan assumes: after each micro-batch's backward the stage's gradients
    are FSDP's sharded DTensor gradients (reshard) or the unsharded parameters' plain ones (keep)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert _sharded_after_each_backward(mesh, reshard=False) == [False, False]
        assert _sharded_after_each_backward(mesh, reshard=True) == [True, True]
    finally:
        dist.destroy_process_group()


def _sharded_after_each_backward(mesh, reshard: bool) -> list[bool]:
    """Two 1F1B micro-batches through one FSDP stage; for each backward, whether the gradients left
    behind are all sharded. The second step is the one recorded (the first also infers shapes)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B
    from torch.distributed.tensor import DTensor

    from dtlaunch.train.parallel.pipeline import make_stage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    stage = make_stage(model, 0, 1, torch.device("cpu"), dist.group.WORLD, reshard)
    sharded: list[bool] = []
    backward = stage.backward_maybe_with_nosync

    def recorded(*args, **kwargs):
        out = backward(*args, **kwargs)
        sharded.append(all(isinstance(p.grad, DTensor) for p in model.parameters()))
        return out

    stage.backward_maybe_with_nosync = recorded
    schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda out, y: out.sum(), scale_grads=False)
    for _ in range(2):
        sharded.clear()
        schedule.step(torch.randn(4, 8), target=torch.randn(4, 8))
        model.zero_grad(set_to_none=True)
    return sharded
