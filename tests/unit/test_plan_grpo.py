"""objective=grpo in the memory plan: the generation phase holds the KV cache of every row a rank
generates, and it is the peak where generation outweighs training (the 1-GPU recipe)."""

from __future__ import annotations

import json

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.plan.generation import PHASE_GENERATION, PHASE_OLD_POLICY
from dtlaunch.plan.memory import plan_memory

GIB = 2**30


def job_of(tmp_path, *overrides: str):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1", "answer": "1"}) + "\n")
    tok = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"<unk>": 0, "w1": 1}, unk_token="<unk>")).save(str(tok))
    return load_job(
        [*overrides, "data.kind=jsonl", "data.format=prompt", f"data.path={prompts}", f"data.tokenizer={tok}"]
    )


def plan(tmp_path, *overrides: str):
    job = job_of(tmp_path, *overrides)
    return plan_memory(job.cfg, job.layout).worst


def test_qwen3_0_6b_recipe_plans_the_generation_phase(tmp_path) -> None:
    """The recipe peaks in backward; under full AC the generation phase is the peak, and its lines are the
    KV cache and the larger of the prefill's block working set and a decode step's logits: the prefill runs
    each distinct prompt once (8 of the 64 rows) and projects its last position only, so no rows x prompt x
    vocabulary logits (64 x 256 x 151,936 in bf16, 4.6 GiB) are counted."""
    assert plan(tmp_path, "recipe=qwen3_0.6b_grpo").phase == "backward"
    # (The loss chunked: on this GPU profile auto would take the full-vocabulary pass, whose logits peak.)
    worst = plan(tmp_path, "recipe=qwen3_0.6b_grpo", "training.activation_checkpointing=full", "training.loss_chunks=8")
    assert worst.phase == PHASE_GENERATION
    # Qwen3-0.6B (its config.json): 28 layers, 8 KV heads of 128; 64 rows of 1,280 positions in bf16.
    assert worst.lines["KV cache"] == 28 * 2 * 8 * 128 * 64 * 1280 * 2
    # The prefill: 8 distinct prompts x 256 positions x (q 2,048 + k, v 1,024 each + SwiGLU 3 x 3,072 + the
    # 1,024-wide input), 59 MB; below a decode step's 64 rows of bf16 logits and four fp32 sampling buffers.
    prefill = 8 * 256 * (2048 + 2 * 1024 + 3 * 3072 + 1024) * 2
    step = 64 * 151_936 * 2 + 4 * 64 * 151_936 * 4
    assert prefill < step and worst.lines["prefill / sampling buffers"] == step
    assert "accumulated gradients" not in worst.lines  # freed by the previous step
    assert worst.peak < 79 * GIB


def test_8b_fsdp_recipe_fits_both_phases(tmp_path) -> None:
    worst = plan(tmp_path, "recipe=qwen3_8b_grpo_fsdp", "objective.num_iterations=2")
    assert {PHASE_GENERATION, PHASE_OLD_POLICY, "backward"} <= set(worst.phases)
    assert max(worst.phases.values()) == worst.peak < 79 * GIB


def test_search_ranks_only_layouts_grpo_runs_with_both_phases_planned() -> None:
    """`plan --search` for GRPO: every row is a layout validate accepts (no PP / CP, whole groups per
    rank; tensor parallel among them), its memory is the larger phase's, and its step time holds the rollout: at least one read
    of every weight per generated token at the device's memory bandwidth (decode is memory bound)."""
    from dtlaunch.models.registry import model_spec
    from dtlaunch.plan.search import search

    base = ["recipe=qwen3_0.6b_grpo", "launch.nproc_per_node=8"]
    cfg = load_job(base).cfg
    rows = search(cfg, top=50)
    assert rows and {r["zero_stage"] for r in rows} >= {0, 3}  # DDP and FSDP both ranked
    assert any(r["tp"] > 1 for r in rows)
    params = model_spec(cfg.model).param_count(cfg.model)
    floor = int(cfg.objective.max_completion_length) * params * 2 / (float(cfg.hardware.memory_gbps) * 1e9)
    for r in rows[:: max(1, len(rows) // 6)]:
        assert r["pp"] == r["cp"] == 1
        job = load_job([*base, *r["overrides"]])  # validate accepts it
        worst = plan_memory(job.cfg, job.layout).worst
        assert worst.peak == max(worst.phases.values()) and PHASE_GENERATION in worst.phases
        assert r["times"]["generation"] >= floor / r["tp"]  # TP ranks each read their shards
    # FSDP gathers the weights for the rollout; DDP holds them: with everything else equal, it generates faster.
    same = {(r["micro_batch"], r["ac"]): r for r in rows if r["zero_stage"] == 0 and r["tp"] == 1}
    fsdp = next(r for r in rows if r["zero_stage"] == 3 and r["tp"] == 1 and (r["micro_batch"], r["ac"]) in same)
    assert fsdp["times"]["generation"] > same[(fsdp["micro_batch"], fsdp["ac"])]["times"]["generation"]


def test_maximize_generations_and_completion_length_find_the_edge() -> None:
    """`plan --maximize objective.num_generations` keeps the prompts per step (the global batch moves
    with G); `objective.max_completion_length` keeps the prompts' room (training.seq_len moves with it)."""
    from dtlaunch.plan.maximize import SAVERS, maximize

    base = ["recipe=qwen3_8b_grpo_fsdp"]  # 8 prompts a step on 8 ranks, micro-batch 2, prompts' room 512
    cfg = load_job(base).cfg
    # The recipe's savers as they are (full AC would reach the model's own context: no memory edge there).
    pinned = {s.key for s in SAVERS}
    g = maximize(cfg, "objective.num_generations", pinned)
    assert g.override == f"objective.num_generations={g.value} training.global_batch={8 * g.value}"
    c = maximize(cfg, "objective.max_completion_length", pinned)
    assert c.override == f"objective.max_completion_length={c.value} training.seq_len={512 + c.value}"
    # The next candidate: G + 2 (whole micro-batches of 2 on every rank), one more completion token.
    for found, over in (
        (g, [f"objective.num_generations={g.value + 2}", f"training.global_batch={8 * (g.value + 2)}"]),
        (c, [f"objective.max_completion_length={c.value + 1}", f"training.seq_len={513 + c.value}"]),
    ):
        fits = load_job([*base, *found.override.split(), *found.savers])
        assert plan_memory(fits.cfg, fits.layout).fits
        over_job = load_job([*base, *over, *found.savers])
        assert not plan_memory(over_job.cfg, over_job.layout).fits


def test_workers_decide_what_the_plan_chose(tmp_path) -> None:
    """The plan's choice crossed with the worker's decisions: objective.generation_gather=auto, turned into
    "unit" by the plan (qwen3_8b_grpo_fsdp with 256 rows a rank, as below), reaches the config.yaml the
    launcher writes into the run directory, and the decisions a worker computes from that file (as
    build_runtime does) equal the launcher's, field by field."""
    from dtlaunch.commands.plan import take_plan_choices
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.launch.rundir import create_run_dir
    from dtlaunch.run.run_dir import CONFIG_NAME

    job = load_job(["recipe=qwen3_8b_grpo_fsdp", "training.global_batch=2048", f"run.dir={tmp_path / 'run'}"])
    plan = plan_memory(job.cfg, job.layout)
    assert job.decisions.generation_gather == "whole" and plan.generation_gather == "unit"
    take_plan_choices(job, plan)
    cfg = load_resolved(create_run_dir(job.cfg, job.recipe) / CONFIG_NAME)
    worker = Decisions.of(cfg, Layout.resolve(cfg.strategy, job.layout.world))
    assert worker == job.decisions and worker.generation_gather == "unit"


def test_auto_gathers_one_unit_at_a_time_only_where_the_whole_model_does_not_fit() -> None:
    """qwen3_8b_grpo_fsdp with 256 rows a rank: gathered whole for generation it needs 82 GiB of the H100's
    79; one unit at a time fits (70 GiB), and `auto` (the default) chooses it, says so, and the step-time model
    charges an all-gather per decode step. At the recipe's own 8 rows `auto` stays whole."""
    from dtlaunch.plan.generation_time import generation_seconds

    def planned(*extra: str):
        job = load_job(["recipe=qwen3_8b_grpo_fsdp", *extra])
        return job, plan_memory(job.cfg, job.layout)

    _, whole = planned("training.global_batch=2048", "objective.generation_gather=whole")
    job, auto = planned("training.global_batch=2048")
    assert not whole.fits and auto.fits and auto.generation_gather == "unit"
    assert any("one FSDP unit at a time" in n for n in auto.notes)
    assert auto.to_dict()["generation_gather"] == "unit"
    from rich.console import Console

    from dtlaunch.commands.plan import print_plan

    shown = Console(record=True, width=200)
    print_plan(auto, shown)  # `dtlaunch plan` and train's gate print the note, not only --json
    assert "note: generation gathers the weights one FSDP unit at a time" in shown.export_text()
    gen = whole.worst.phases[PHASE_GENERATION] - auto.worst.phases[PHASE_GENERATION]
    assert 10 * GIB < gen < 15.3 * GIB  # the whole bf16 model (15.3 GiB), less the embedding and one block's gather
    unit_job, _ = planned("training.global_batch=2048", "objective.generation_gather=unit")
    assert unit_job.decisions.generation_gather == "unit"
    slow = generation_seconds(unit_job.cfg, unit_job.decisions, 0.5)
    assert slow > generation_seconds(job.cfg, job.decisions, 0.5)  # job: auto reads as whole before the plan
    _, small = planned()
    assert small.generation_gather == "whole" and small.fits


def test_generation_gather_outside_zero3_is_refused() -> None:
    from dtlaunch.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_job(["recipe=qwen3_0.6b_grpo", "objective.generation_gather=unit"])
    msg = str(err.value)
    assert "objective.generation_gather=unit" in msg and "leave objective.generation_gather=auto" in msg
    assert "\n" not in msg


def test_the_tool_process_is_a_host_line(tmp_path) -> None:
    """A user reward function (like tools and environments) runs in a child process per rank, limited to
    objective.tool_memory_mb of address space: the plan counts that much host RAM per rank, and none when the
    user code runs in the worker (tool_timeout_s=0) or only built-in rewards run."""
    from dtlaunch.plan.lines import Line

    reward = tmp_path / "my_reward.py"
    reward.write_text("def r(prompts, completions, completion_ids, **kw):\n    return [1.0] * len(completions)\n")
    user = [f"objective.rewards=[{reward}:r]", "objective.tool_memory_mb=3072"]
    worst = plan(tmp_path, "recipe=qwen3_0.6b_grpo", *user)
    assert worst.host == {Line.TOOL_PROCESS_HOST: 3072 * 2**20}
    assert plan(tmp_path, "recipe=qwen3_0.6b_grpo", *user, "objective.tool_timeout_s=0").host == {}
    assert plan(tmp_path, "recipe=qwen3_0.6b_grpo").host == {}


@pytest.mark.parametrize("tp", [1, 2])
def test_deepseek_v3_generation_plans_its_latent_cache(tmp_path, tp: int) -> None:
    """DeepSeek-V3 generates from its latent cache (dtlaunch/models/deepseek_v3/mla.py): the plan's KV cache
    line is layers x (kv_lora_rank + qk_rope_head_dim) x rows x positions x bytes, the same on every tensor
    parallel rank (the latent is whole on each): 71x less than the per-head keys and values (40,960 values per
    position and layer), 36x less than a TP(2) rank's half of them; plus each block's absorbed wkv_b matrix
    (this rank's heads), kept for the generation. The runtime's cache tensors are measured
    against kv_cache_bytes in test_batch_generate.py::test_deepseek_v3_caches_its_latent_as_the_plan_counts."""
    from dtlaunch.plan.generation import generation_rows, kv_cache_bytes
    from dtlaunch.plan.shape import stage_shape

    small = ["model=deepseek_v3_671b", "model.n_layers=4", "model.moe.num_experts=8", "model.moe.top_k=2"]
    layout = ["strategy=tp", "launch.nproc_per_node=2"] if tp > 1 else []
    job = job_of(tmp_path, "recipe=qwen3_0.6b_grpo", *small, "model.moe.n_group=2", "model.moe.topk_group=1", *layout)
    c = stage_shape(job.cfg, job.layout, 0, 4, True, True)
    assert c.tp == tp
    seq, completion = int(c.training.seq_len), int(job.cfg.objective.max_completion_length)
    positions = -(-(seq - completion) // tp) * tp + completion + tp - 1  # sequence parallel: padding, fillers
    absorbed = 4 * 512 * 128 * (128 + 128) / tp * 2  # each block's wkv_b matrix, this rank's heads
    assert kv_cache_bytes(c) == 4 * (512 + 64) * generation_rows(c) * positions * 2 + absorbed  # bf16
    per_head = 4 * 128 * (192 + 128) / tp * generation_rows(c) * positions * 2  # this rank's heads' keys, values
    assert per_head / (kv_cache_bytes(c) - absorbed) == pytest.approx(40_960 / 576 / tp)
