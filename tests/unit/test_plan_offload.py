"""The plan of offloading: device lines shrink by exactly what the host lines hold, the host RAM of a node
is a limit of its own (exit 3 with one line), the layout search reaches for offload only when nothing
fits without it, and `plan --maximize` finds the largest value that fits."""

from __future__ import annotations

import sys

import pytest

from dtlaunch.cli import run
from dtlaunch.commands.common import load_job
from dtlaunch.plan import offload
from dtlaunch.plan.lines import Line
from dtlaunch.plan.maximize import maximize
from dtlaunch.plan.memory import GIB, plan_memory
from dtlaunch.plan.search import search
from dtlaunch.plan.stage import forward_lines, stage_shape, static_lines

LLAMA8B = ["model=llama3_8b", "hardware=h100_80gb", "launch.nproc_per_node=8", "strategy=fsdp", "precision=bf16"]
LLAMA70B = ["model=llama3_70b", "hardware=a100_80gb", "launch.nproc_per_node=8", "strategy=fsdp", "precision=bf16"]


def _plan(*overrides: str):
    job = load_job(list(overrides))
    return job, plan_memory(job.cfg, job.layout)


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
@pytest.mark.parametrize("switch", ["training.activation_offload=true", "strategy.cpu_offload=true"])
def test_device_lines_shrink_by_exactly_the_host_lines(ac: str, switch: str) -> None:
    job, _ = _plan(*LLAMA8B, f"training.activation_checkpointing={ac}", switch)
    c = stage_shape(job.cfg, job.layout, 0, 32, True, True)
    before = {**static_lines(c), **forward_lines(c)}
    device, host = offload.split(c, before)
    assert host and sum(host.values()) > 0
    assert sum(device.values()) + sum(host.values()) == pytest.approx(sum(before.values()), rel=1e-12)
    assert all(device[k] <= before[k] for k in before)


def test_cpu_offload_leaves_no_model_state_on_the_device() -> None:
    _, plain = _plan(*LLAMA70B, "training.activation_checkpointing=full", "strategy.cpu_offload=false")
    _, off = _plan(*LLAMA70B, "training.activation_checkpointing=full", "strategy.cpu_offload=true")
    assert not plain.fits and off.fits  # 16 B/param over 8 ranks cannot fit 80 GB; on the host it does
    for k in ("parameters", "optimizer state"):
        assert off.worst.lines.get(k, 0.0) == 0.0 and plain.worst.lines[k] > 0
    host = off.worst_host
    shard = 70_553_706_496 / 8
    assert host["parameters (host)"] == pytest.approx(4 * shard, rel=1e-3)
    assert host["optimizer state (host)"] == pytest.approx(8 * shard, rel=1e-3)
    assert off.host_total == pytest.approx(8 * off.host_per_rank)  # eight ranks share a node's RAM
    assert off.peak < 25 * GIB


def _run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    return int(exc.value.code or 0)


def test_host_overflow_does_not_fit_with_one_line(monkeypatch, capsys) -> None:
    args = [*LLAMA70B, "training.activation_checkpointing=full", "strategy.cpu_offload=true"]
    _, plan = _plan(*args, "hardware.host_memory_gib=512")
    assert plan.headroom > 0 and not plan.host_fits and not plan.fits
    assert _run_cli(["plan", *args, "hardware.host_memory_gib=512"], monkeypatch) == 3
    assert "GiB of host RAM per node (8 ranks x" in capsys.readouterr().out
    assert _run_cli(["train", *args, "hardware.host_memory_gib=512"], monkeypatch) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit host RAM" in err[0] and "hardware.host_memory_gib" in err[0]


def test_search_offloads_only_what_does_not_fit_otherwise() -> None:
    job, _ = _plan(*LLAMA70B, "training.micro_batch=1", "training.seq_len=2048")
    rows = search(job.cfg, top=3)
    assert rows and all(r["cpu_offload"] for r in rows)  # 70B full training needs the host on 8 GPUs
    assert rows[0]["times"]["offload"] > 0 and "strategy.cpu_offload=true" in rows[0]["overrides"]
    job8, _ = _plan(*LLAMA8B, "training.seq_len=2048")
    assert not any(r["cpu_offload"] or r["activation_offload"] for r in search(job8.cfg, top=3))


def test_offload_with_compile_is_planned_and_searched() -> None:
    """Under compile with full AC, activation offload is planned (the compiled blocks' inputs on the host)
    and the layout search may offer it; without full AC it is neither."""
    args = ["recipe=llama3_8b_qlora", "training.seq_len=65536", "training.micro_batch=1", "training.global_batch=1"]
    job, plan = _plan(*args, "training.activation_offload=true")
    assert job.cfg.training.compile and plan.worst.host[Line.HOST_ACTIVATIONS] > 0
    _, kept = _plan(*args, "training.activation_offload=false")
    assert plan.peak < kept.peak
    _, default = _plan(*args)  # the default turns it on here: full AC on a GPU profile costs no step time
    assert default.peak == plan.peak
    tr = {"activation_checkpointing": "full"}
    lay, st = job.layout, {"zero_stage": 0}
    assert (False, True) in offload.offload_variants(job.cfg, lay, st, tr)
    assert (False, True) not in offload.offload_variants(job.cfg, lay, st, {"activation_checkpointing": "selective"})


@pytest.mark.parametrize("key", ["training.seq_len", "training.micro_batch"])
def test_maximize_finds_the_edge(key: str) -> None:
    # The model's own limit lifted: the edge is memory's, not max_seq_len's.
    args = [*LLAMA8B, "training.global_batch=0", "training.activation_checkpointing=full", "model.max_seq_len=4194304"]
    job, _ = _plan(*args)
    found = maximize(job.cfg, key)
    assert found.value and found.plan.fits
    _, over = _plan(*args, f"{key}={found.value + 1}", *found.savers)  # the savers it turned on, as pasted
    assert not over.fits


def test_maximize_other_keys_exit_2(monkeypatch, capsys) -> None:
    assert _run_cli(["plan", "--maximize", "training.steps"], monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.steps" in err[0] and "training.seq_len" in err[0]


def test_suggestions_offer_offload_when_model_states_do_not_fit() -> None:
    from dtlaunch.plan.suggest import suggest

    job, plan = _plan(*LLAMA70B, "training.micro_batch=2", "training.seq_len=2048")
    assert not plan.fits
    fixes = suggest(job.cfg, job.layout)
    assert fixes and all("strategy.cpu_offload=true" in f["overrides"] for f in fixes)


ONE_4090 = ["model=llama3_8b", "hardware=rtx4090_24gb", "launch.nproc_per_node=1", "precision=bf16"]


def test_full_fine_tune_of_8b_fits_one_24gb_card_with_its_state_on_the_host() -> None:
    """ZeRO-Offload on one GPU: FSDP over a 1-rank mesh keeps the fp32 parameters, gradients and AdamW
    state on the host; the device holds a gathered block at a time (torchtune measured 18.9 GiB for the
    same job with bf16 weights and paged 8-bit AdamW)."""
    job = [*ONE_4090, "training.micro_batch=2", "training.seq_len=2048", "training.activation_checkpointing=full"]
    _, plain = _plan(*job, "strategy=ddp")
    assert not plain.fits
    _, off = _plan(*job, "strategy=fsdp", "strategy.cpu_offload=true")
    assert off.fits and off.peak <= 18.9 * GIB
    params = 8.03e9
    assert off.worst_host["parameters (host)"] == pytest.approx(4 * params, rel=0.01)
    assert off.worst_host["optimizer state (host)"] == pytest.approx(8 * params, rel=0.01)


def test_search_on_one_gpu_reaches_for_the_host_only_when_nothing_else_fits() -> None:
    job, _ = _plan(*ONE_4090, "training.micro_batch=1", "training.seq_len=2048")
    rows = search(job.cfg, top=3)
    assert rows and all(r["cpu_offload"] and r["zero_stage"] >= 2 for r in rows)
    small, _ = _plan(*ONE_4090, "model=tiny", "training.seq_len=256")
    assert not any(r["cpu_offload"] or r["zero_stage"] for r in search(small.cfg, top=3))
