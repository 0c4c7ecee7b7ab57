"""`dtlaunch plan` and the train gate as a user runs them."""

import json
import re
import subprocess


def _run(*args):
    return subprocess.run(["dtlaunch", *args], capture_output=True, text=True)


def test_plan_refuses_ddp_8b_with_exit_3_and_suggestion():
    r = _run("plan", "recipe=llama8b_ddp")
    assert r.returncode == 3
    assert "does not fit" in r.stdout and "strategy.zero_stage" in r.stdout


def test_plan_json_fits_for_fsdp_8b():
    r = _run("plan", "recipe=llama8b_fsdp", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["fits"] and data["peak_bytes"] > 0 and "activations" in data["categories"]


def test_train_refuses_and_dry_run_exit_codes():
    r = _run("train", "recipe=llama8b_ddp")
    assert r.returncode == 3 and "--force" in r.stderr and "Traceback" not in r.stderr
    assert _run("train", "recipe=llama8b_ddp", "--dry-run").returncode == 3
    assert _run("train", "recipe=llama8b_fsdp", "--dry-run").returncode == 0


def test_search_prints_layouts():
    r = _run("plan", "recipe=llama8b_fsdp", "--search", "--top", "3")
    assert r.returncode == 0 and "layouts that fit" in r.stdout


def test_trace_prints_the_traced_peak_beside_the_plan():
    """`plan --trace` shows a table (the traced peak, the plan's peak of the same stage, the difference), not
    the raw record (that is --json's)."""
    r = _run("plan", "recipe=tiny_ddp", "--trace")
    assert r.returncode == 0, r.stderr
    assert "traced peak" in r.stdout and "planned peak (same stage)" in r.stdout and "plan − trace" in r.stdout
    assert '"peak_bytes"' not in r.stdout
    assert re.search(r"plan − trace\s+│\s+[+-]\d+\.\d\d %", r.stdout), r.stdout


def test_train_runs_the_loss_the_plan_chose(tmp_path):
    """training.loss_chunks=auto on a GPU profile (here the CPU's gloo workers under a 2-GPU profile): the
    plan takes the full-vocabulary pass, which fits, the run's config.yaml says so, and the workers run it:
    their measured peak is the full pass's plan, not the chunked loss's."""
    run = tmp_path / "run"
    gpu = ["recipe=tiny_ddp", "hardware.gpus_per_node=2", "hardware.host_memory_gib=24", "model.vocab_size=65536"]
    r = _run("train", *gpu, "training.steps=2", "training.loss_plot=false", f"run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "one full-vocabulary pass" in r.stdout
    plan = json.loads((run / "plan.json").read_text())
    assert plan["loss_chunks"] == 1
    assert re.search(r"^\s+loss_chunks: 1$", (run / "config.yaml").read_text(), re.M)
    summary = json.loads((run / "summary.json").read_text())
    assert abs(summary["peak_mem_bytes_measured"] / plan["peak_bytes"] - 1) < 0.01, (summary, plan["peak_bytes"])
    chunked = json.loads(_run("plan", *gpu, "training.loss_chunks=8", "--json").stdout)
    assert chunked["peak_bytes"] < 0.9 * summary["peak_mem_bytes_measured"]  # the full pass really ran
