"""objective=grpo in the memory plan: the generation phase holds the KV cache of every row a rank
generates, and it is the peak where generation outweighs training (the 1-GPU recipe)."""

from __future__ import annotations

import json

from dtlaunch.commands.common import load_job
from dtlaunch.plan.generation import PHASE_GENERATION, PHASE_OLD_POLICY
from dtlaunch.plan.memory import plan_memory

GIB = 2**30


def plan(tmp_path, *overrides: str):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1", "answer": "1"}) + "\n")
    tok = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"<unk>": 0, "w1": 1}, unk_token="<unk>")).save(str(tok))
    job = load_job(
        [*overrides, "data.kind=jsonl", "data.format=prompt", f"data.path={prompts}", f"data.tokenizer={tok}"]
    )
    return plan_memory(job.cfg, job.layout).worst


def test_qwen3_0_6b_recipe_peaks_in_generation(tmp_path) -> None:
    worst = plan(tmp_path, "recipe=qwen3_0.6b_grpo")
    assert worst.phase == PHASE_GENERATION
    # Qwen3-0.6B (its config.json): 28 layers, 8 KV heads of 128; 64 rows of 1,280 positions in bf16.
    assert worst.lines["KV cache"] == 28 * 2 * 8 * 128 * 64 * 1280 * 2
    assert "accumulated gradients" not in worst.lines  # freed by the previous step
    assert worst.peak < 79 * GIB


def test_8b_fsdp_recipe_fits_both_phases(tmp_path) -> None:
    worst = plan(tmp_path, "recipe=qwen3_8b_grpo_fsdp", "objective.num_iterations=2")
    assert {PHASE_GENERATION, PHASE_OLD_POLICY, "backward"} <= set(worst.phases)
    assert max(worst.phases.values()) == worst.peak < 79 * GIB
