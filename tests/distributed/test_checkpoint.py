"""CheckpointManager under real layouts (gloo workers, CPU).

Each case runs `worker_main` (below) on torchrun's ranks, forked from pytest (forked_ranks.run_ranks), with a
mode and config overrides. The worker builds the runtime from the real pieces (mesh, parallelize, AdamW +
schedule, TokenLoader), resumes, trains, saves on the cadence and writes what the test compares: per-step
losses, the sample indices each rank consumed, and (rank 0) the full model + optimizer state after resume.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from forked_ranks import run_ranks

BASE = [
    "model=tiny",
    "training.seq_len=32",
    "training.micro_batch=2",
    "training.steps=6",
    "optim.warmup_steps=2",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=5",
    "hardware=cpu",
    "launch.timeout_s=120",
]
LAYOUTS = {
    "single": (1, ["strategy.dp_shard=1", "strategy.zero_stage=0"]),
    "ddp2": (2, ["strategy.dp_shard=2", "strategy.zero_stage=0"]),
    "zero1_2": (2, ["strategy.dp_shard=2", "strategy.zero_stage=1"]),
    "fsdp2": (2, ["strategy.dp_shard=2", "strategy.zero_stage=3"]),
    "fsdp4": (4, ["strategy.dp_shard=4", "strategy.zero_stage=3", "training.micro_batch=1"]),
    "tp2": (2, ["strategy.dp_shard=1", "strategy.tp=2", "strategy.zero_stage=0"]),
}


def run_worker(
    layout: str, run_dir: Path, out: Path, *extra: str, stop_at: int = 0, dump_state: bool = False, expect_rc: int = 0
) -> dict:
    nproc, overrides = LAYOUTS[layout]
    env = dict(os.environ, OMP_NUM_THREADS="1", DTLAUNCH_RUN_DIR=str(run_dir))
    # Global batch fixed at 4 samples so every layout trains on the same samples per step.
    gb = ["training.global_batch=4"]
    args = [*BASE, *gb, *overrides, *extra]
    proc = run_ranks(nproc, lambda: worker_main(out, stop_at, dump_state, args), env=env)
    assert proc.returncode == expect_rc, proc.stdout[-9000:]
    result = json.loads(out.read_text()) if out.exists() else {}
    result["stdout"] = proc.stdout
    return result


def _states_equal(a: Path, b: Path) -> None:
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.slow
# DDP, FSDP, TP and PP resume bit-identically through the CLI in tests/e2e/test_resume_cli.py and
# tests/e2e/test_fault_tolerance.py; ZeRO-1's optimizer is saved by a path of its own, tested here.
@pytest.mark.parametrize("layout", ["zero1_2"])
@pytest.mark.slow_reason("three runs: uninterrupted, stopped at step 3, resumed")
def test_interrupted_equals_uninterrupted(layout: str, tmp_path: Path) -> None:
    straight = run_worker(layout, tmp_path / "a", tmp_path / "a.json")
    first = run_worker(layout, tmp_path / "b", tmp_path / "b1.json", stop_at=3)
    assert (tmp_path / "b" / "checkpoints" / "step-00000003" / "COMPLETE.json").is_file()
    second = run_worker(layout, tmp_path / "b", tmp_path / "b2.json")
    assert "resumed from step-00000003" in second["stdout"]
    assert first["losses"] == straight["losses"][:3]
    # Bit-identical in fp32: the losses are compared as exact floats.
    assert second["losses"] == straight["losses"][3:], (second["losses"], straight["losses"])
    assert second["start"] == 3
    # The data stream continues: no sample repeated or skipped.
    assert first["samples"] + second["samples"] == straight["samples"]


@pytest.fixture(scope="module")
def fsdp2_stopped_at_3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """One FSDP(2) run stopped after its step-3 checkpoint, and one uninterrupted single-process run of
    the same 6 steps: shared by every cross-layout target, which resumes from a copy of the run."""
    base = tmp_path_factory.mktemp("fsdp2_at_3")
    first = run_worker("fsdp2", base / "run", base / "a.json", stop_at=3, dump_state=True)
    straight = run_worker("single", base / "ref", base / "ref.json")
    return base / "run", first, straight


@pytest.mark.slow
@pytest.mark.slow_reason("the first target pays the module's FSDP2 run stopped at step 3 and its uninterrupted twin")
@pytest.mark.parametrize("target", ["fsdp4", "single", "tp2", "ddp2"])
def test_cross_layout_resume(target: str, fsdp2_stopped_at_3: tuple[Path, dict, dict], tmp_path: Path) -> None:
    saved, first, straight = fsdp2_stopped_at_3
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    resumed = run_worker(target, run, tmp_path / "b.json", "training.steps=6", dump_state=True)
    assert resumed["start"] == 3
    assert "written by world 2" in resumed["stdout"]
    # Model and optimizer tensors after load equal those saved (full, unsharded view on both sides).
    _states_equal(Path(first["state_at_stop"]), Path(resumed["state_after_resume"]))
    # Data position continues: global sample order, no repeats or gaps, whatever the dp size.
    assert first["samples"] + resumed["samples"] == straight["samples"]
    # Losses continue on the same trajectory (reduction order differs across layouts: close, not identical).
    for x, y in zip(resumed["losses"], straight["losses"][3:], strict=True):
        assert abs(x - y) < 1e-4, (resumed["losses"], straight["losses"])


@pytest.mark.slow
@pytest.mark.slow_reason("a run saving asynchronously every step, then its checkpoints read back")
def test_async_save_snapshot_and_keep_last(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = run_worker(
        "fsdp2",
        run,
        tmp_path / "a.json",
        "checkpoint.async_save=true",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
        dump_state=True,
    )
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000006"], names
    assert "async save started" in res["stdout"]
    # Resuming from the async-written step 6 gives exactly the state that training had at step 6.
    again = run_worker("fsdp2", run, tmp_path / "b.json", "checkpoint.async_save=true", dump_state=True)
    assert again["start"] == 6 and again["losses"] == []
    _states_equal(Path(res["state_at_stop"]), Path(again["state_after_resume"]))


@pytest.mark.slow
def test_corrupt_checkpoint_is_skipped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_worker("ddp2", run, tmp_path / "a.json", "training.steps=6")
    shard = next((run / "checkpoints" / "step-00000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated shard: marker no longer matches
    res = run_worker("ddp2", run, tmp_path / "b.json", "training.steps=6")
    assert "skipping checkpoint step-00000006" in res["stdout"]
    assert res["start"] == 3


@pytest.fixture(scope="module")
def single_stopped_at_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One single-process run stopped after its step-3 checkpoint; each test spoils a copy of it."""
    base = tmp_path_factory.mktemp("single_at_3")
    run_worker("single", base / "run", base / "a.json", stop_at=3)
    return base / "run"


@pytest.mark.slow
def test_no_resume_refuses(single_stopped_at_3: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(single_stopped_at_3, run)
    os.environ["DTLAUNCH_NO_RESUME"] = "1"
    try:
        res = run_worker("single", run, tmp_path / "b.json", expect_rc=1)
    finally:
        del os.environ["DTLAUNCH_NO_RESUME"]
    assert "already has checkpoints" in res["stdout"]


@pytest.mark.slow
def test_save_failure_keeps_previous(single_stopped_at_3: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(single_stopped_at_3, run)
    # A plain file where the next save's directory must go: the write fails with an OSError, as on a
    # full disk or a read-only mount, and must neither hide the error nor touch step 3.
    (run / "checkpoints" / ".tmp-step-00000006").write_text("in the way")
    res = run_worker("single", run, tmp_path / "b.json", expect_rc=1)
    assert "saving checkpoint into" in res["stdout"] and "step-00000003 is intact" in res["stdout"], res["stdout"]
    assert (run / "checkpoints" / "step-00000003" / "COMPLETE.json").is_file()


# ---------------------------------------------------------------------------------------------
# The worker.


def _full_state(model: object, optimizer: object) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Every rank keeps the gathered tensors: cpu_offload would only add the rank-0-only drop path, and on
    # CPU the offload itself is a no-op.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False, flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, [optimizer], options=opts)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    out.update({f"optim.{k}": v.detach().clone() for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return out


def worker_main(out: Path, stop_at: int, dump_state: bool, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.errors import DtlaunchError
    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.checkpoint.manager import CheckpointManager
    from dtlaunch.train.data import build_loader
    from dtlaunch.train.loss import cross_entropy, loss_context
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.mesh import build_mesh, dp_mesh, dp_rank_size
    from dtlaunch.train.parallel.parallelize import parallelize
    from dtlaunch.train.parallel.process_group import init_distributed

    run_dir = Path(os.environ["DTLAUNCH_RUN_DIR"])
    cfg = compose(overrides).cfg
    env = init_distributed(cfg)
    layout = Layout.resolve(cfg.strategy, env.world)
    mesh = build_mesh(layout, "cpu")
    model = build_model(cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
    model = parallelize(model, mesh, cfg, Decisions.of(cfg, layout))
    zero1 = dp_mesh(mesh, flatten=True).get_group() if cfg.strategy.zero_stage == 1 else None
    opt = build_optimizer(model, cfg, env.device, zero1_group=zero1)
    sched = build_scheduler(opt, cfg)
    dp_rank, dp_size = dp_rank_size(mesh)
    loader = build_loader(cfg, run_dir, dp_rank, dp_size)
    mgr = CheckpointManager(cfg, run_dir, [model], [opt], [sched], loader, env.rank)
    result: dict = {"losses": [], "samples": []}
    try:
        start = mgr.resume()
    except DtlaunchError as exc:
        print(f"dtlaunch: error: {exc}", flush=True)
        sys.exit(exc.exit_code)
    result["start"] = start
    # Only after a resume: on a fresh optimizer get_state_dict would initialise AdamW's state by a zero
    # step, shifting its bias correction - a different trajectory from the run it is compared with.
    if dump_state and start > 0:
        state = _full_state(model, opt)
        if env.rank == 0:
            torch.save(state, out.with_suffix(".resume.pt"))
            result["state_after_resume"] = str(out.with_suffix(".resume.pt"))
    steps = stop_at or int(cfg.training.steps)
    accum = Decisions.of(cfg, layout).grad_accum
    for step in range(start + 1, steps + 1):
        total = torch.zeros(())
        step_samples: list[int] = []
        for _ in range(accum):
            # Which global samples this micro-step holds (all dp ranks), before the loader advances.
            base = loader.consumed
            step_samples += [loader.sample_index(base + i) for i in range(loader.micro_batch * dp_size)]
            batch = loader.next_batch()
            x, y = batch.inputs, batch.targets
            with loss_context(cfg, layout):
                loss = cross_entropy(model(x), y) / accum
                loss.backward()
            part = loss.detach()
            total += part.full_tensor() if hasattr(part, "full_tensor") else part
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if dp_size > 1:
            dist.all_reduce(total, group=dp_mesh(mesh, flatten=True).get_group())
            total /= dp_size
        result["losses"].append(total.item())
        result["samples"] += step_samples
        try:
            mgr.maybe_save(step)
        except DtlaunchError as exc:
            print(f"dtlaunch: error: {exc}", flush=True)
            sys.exit(exc.exit_code)
    mgr.save(steps, final=True)
    mgr.close()
    if dump_state:
        state = _full_state(model, opt)
        if env.rank == 0:
            torch.save(state, out.with_suffix(".stop.pt"))
            result["state_at_stop"] = str(out.with_suffix(".stop.pt"))
    if env.rank == 0:
        out.write_text(json.dumps(result))
    # The runtime's own exit (barrier, destroy, os._exit): a gloo worker that unwinds the interpreter
    # normally sometimes dies in C++ teardown after its work is done (SIGABRT/SIGSEGV at exit).
    from dtlaunch.train.parallel.process_group import shutdown

    shutdown()
