"""The analytic planner: known byte counts, recipes, suggestions, search; no torch on these paths."""

import subprocess
import sys

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.job.compose import list_recipes
from dtlaunch.job.validate import validate
from dtlaunch.models.dense import activations as act
from dtlaunch.models.shapes import param_count
from dtlaunch.plan.memory import plan_memory
from dtlaunch.plan.search import search
from dtlaunch.plan.suggest import _apply, suggest


def _plan(*overrides):
    job = load_job(list(overrides))
    return job, plan_memory(job.cfg, job.layout)


@pytest.mark.parametrize(("hardware", "temp"), [("h100_80gb", 0), ("cpu", 4)])
def test_ddp_fp32_model_states_are_16_bytes_per_param(hardware, temp):
    job, plan = _plan("model=llama3_8b", "strategy=ddp", "launch.nproc_per_node=8", f"hardware={hardware}")
    P = param_count(job.cfg.model)
    assert plan.worst.params == P
    # params + grads + DDP's flat buckets (the runtime does not use gradient_as_bucket_view) + Adam, plus
    # on CPU the foreach temporary (4 B/param; GPU runs use fused AdamW), plus the RoPE tables.
    states = plan.worst.phases["optimizer"] - plan.worst.lines["buffers"]
    assert states == pytest.approx((20 + temp) * P)
    assert plan.worst.lines["parameters"] + plan.worst.lines["optimizer state"] == pytest.approx(12 * P)


@pytest.mark.parametrize("d", [2, 8])
def test_zero3_model_states_are_16_over_d(d):
    job, plan = _plan("model=llama3_8b", "strategy=zero3", f"launch.nproc_per_node={d}", "hardware=h100_80gb")
    P = param_count(job.cfg.model)
    states = plan.worst.phases["optimizer"] - plan.worst.lines["buffers"]
    assert states == pytest.approx(16 * P / d)


def test_logits_buffers_only_on_last_stage_and_sized_by_vocab():
    job, plan = _plan("model=tiny_deep", "strategy=pp", "launch.nproc_per_node=2", "strategy.pp_microbatches=2")
    d = act.BlockDims.of(job.cfg.model)
    # fp32 log-probs + the logits the runtime keeps referenced; nll + log_softmax fp32 gradients.
    assert act.logits_forward_bytes(d, 2) == 6 * 512
    assert act.logits_backward_bytes(d, 2) == 8 * 512
    assert act.logits_backward_bytes(d, 4) == 8 * 512
    first, last = plan.stages
    assert first.phases["backward"] - first.phases["forward"] != last.phases["backward"] - last.phases["forward"]


def test_1f1b_first_stage_holds_most_microbatches_gpipe_all():
    from dtlaunch.plan.shape import in_flight

    assert [in_flight("1f1b", 4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, i, 8) for i in range(4)] == [8, 8, 8, 8]


def test_ac_ordering_per_block():
    d = act.BlockDims(h=4096, k=1024, f=14336, a=32, vocab=128256)
    none, sel, full = (act.block_bytes(d, 2, m) for m in ("none", "selective", "full"))
    assert full < sel < none
    assert act.block_bytes(d, 2, "none", tp=4, sp=True) < act.block_bytes(d, 2, "none", tp=4, sp=False)


@pytest.mark.parametrize("name", sorted(list_recipes()))
def test_every_recipe_gets_a_plan(name):
    job = load_job([f"recipe={name}"])
    plan = plan_memory(job.cfg, job.layout)
    assert plan.peak > 0 and plan.to_dict()["verdict"] in ("fits", "does not fit")


def test_llama8b_ddp_refused_with_a_valid_suggestion_and_fsdp_fits():
    job, plan = _plan("recipe=llama8b_ddp")
    assert not plan.fits
    sugg = suggest(job.cfg, job.layout)
    assert sugg
    for s in sugg:
        new = _apply(job.cfg, s["overrides"])
        fixed = plan_memory(new, validate(new).layout)
        assert fixed.fits and int(fixed.device_total) == s["device_total_bytes"]
    assert _plan("recipe=llama8b_fsdp")[1].fits


def test_search_keeps_only_fitting_layouts_sorted_by_time():
    job = load_job(["recipe=llama70b_fsdp_tp"])
    rows = search(job.cfg, top=5)
    assert rows and all(r["device_total_bytes"] <= job.cfg.hardware.memory_gib * 1024**3 for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert 0 < rows[0]["mfu"] < 1 and rows[0]["why"] == "fastest"


def test_plan_path_never_imports_torch():
    code = (
        "import sys; from dtlaunch.commands.plan import plan_command; import dtlaunch.plan.search, "
        "dtlaunch.plan.suggest; plan_command(['recipe=llama405b_3d'], [], as_json=True); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_loss_chunks_offered_when_the_logits_do_not_fit():
    """A 32k-vocabulary tiny model at 4k tokens: the full-vocabulary loss's logits dominate; the chunked
    loss is the cheapest suggested fix, and the search plans layouts with it (one extra head matmul)."""
    job = load_job(
        ["model=tiny", "model.vocab_size=32000", "training.micro_batch=8", "training.seq_len=512"]
        + ["training.loss_chunks=1", "hardware.memory_gib=1"]
    )
    plan = plan_memory(job.cfg, job.layout)
    assert not plan.fits
    sugg = suggest(job.cfg, job.layout)
    assert sugg[0]["overrides"] == ["training.loss_chunks=8"], sugg
    rows = search(job.cfg, top=50)
    assert {r["loss_chunks"] for r in rows} == {1, 8}, rows
    chunked = [r for r in rows if r["loss_chunks"] == 8]
    assert all("training.loss_chunks=8" in r["overrides"] for r in chunked)
