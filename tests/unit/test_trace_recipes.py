"""`dtlaunch plan --trace` on every shipped recipe: the traced second opinion, or a one-line reason why this
machine cannot trace the job; never a signal, never an internal error. The command as a user runs it (the
CLI in-process: the stage it picks to trace, its skip lines), on the recipes' layouts, objectives, savers
and compile settings as shipped, at reduced depth and sequence length, traced on the kind of tensors (fake
or real) the full recipe's trace uses. Each recipe runs in a child forked from the test process (imports
already paid): a trace that crashes the interpreter (a compiled kernel reading a fake tensor) fails its
recipe's test, not the session."""

import multiprocessing
import traceback
from pathlib import Path

import pytest
from cli_in_process import run_cli

import dtlaunch
from dtlaunch.commands.common import load_job

RECIPES = sorted(p.stem for p in (Path(dtlaunch.__file__).parent.parent / "recipes").glob("*.yaml"))
TIMEOUT_S = 300


def _shrunk(name: str, full) -> list[str]:
    """The recipe at 2 blocks per pipeline stage and at most 512 positions: the same layout, blocks and
    code paths (compile included), a fraction of the trace's time. Pipelines keep one block on the first
    and the last stage, so that (as in the shipped uneven splits) the plan's most loaded stage, the one
    traced, is a middle stage: one that receives its input from another stage."""
    t = full.cfg.training
    pp = full.layout.pp
    layers = min(int(full.cfg.model.n_layers), 2 * pp - 2 if pp > 2 else 2 * pp)
    seq = min(int(t.seq_len), 512)
    extra = []
    if str(full.cfg.objective.name) == "grpo":  # the completion must leave room for a prompt in the shorter rows
        extra.append(f"objective.max_completion_length={min(int(full.cfg.objective.max_completion_length), seq // 2)}")
    # A smaller vocabulary keeps the head and the chunked loss on the same code paths: on real tensors the
    # 128k-token head of an 8B recipe was most of the trace's time (17-22 s of a LoRA recipe's 20).
    if int(full.cfg.model.vocab_size) > 8192:
        extra.append("model.vocab_size=8192")
    return [f"recipe={name}", f"model.n_layers={layers}", f"training.seq_len={seq}", *extra]


def _plan_trace(argv: list[str], fake: bool, conn) -> None:
    """In the forked child: `dtlaunch plan ARGV --trace`, traced on fake tensors iff `fake` (the full
    recipe's choice: the shrunk job's analytic peak would pick real ones)."""
    try:
        import torch

        import dtlaunch.plan.trace as trace

        torch.set_num_threads(1)
        trace.REAL_TENSOR_LIMIT = 0 if fake else float("inf")
        conn.send(run_cli(["plan", *argv, "--trace"], stdout=True))
    except BaseException:
        conn.send((None, traceback.format_exc()))
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.slow_reason(
    "a real --trace of each shipped recipe's step (the 3D and LoRA ones the slowest): the segfault it guards"
)
@pytest.mark.parametrize("name", RECIPES)
def test_plan_trace_runs_on_every_recipe(name):
    from dtlaunch.plan.trace import real_tensors_needed, skip_reason, traced_with_fake_tensors

    full = load_job([f"recipe={name}"])
    fake = traced_with_fake_tensors(full.cfg, full.layout)
    # Where this machine cannot trace the full recipe, its own command is what must print the one-line
    # reason (the shrunk job might fit and trace, which is not what a user of the recipe sees).
    argv = [f"recipe={name}"] if skip_reason(full.cfg, full.layout) else _shrunk(name, full)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_plan_trace, args=(argv, fake, child))
    proc.start()
    child.close()
    try:
        got = parent.recv() if parent.poll(TIMEOUT_S) else None
    except EOFError:  # the child died before it could answer (a signal: see its exit code)
        got = None
    proc.join(10)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    assert got is not None, f"plan --trace on {name}: no result (child exit code {proc.exitcode}; negative = signal)"
    code, out = got
    assert code is not None, out
    assert "internal error" not in out, out
    skipped = [line for line in out.splitlines() if line.startswith("--trace skipped:")]
    if skipped:  # the analytic plan stands, with one line saying why it was not traced
        assert len(skipped) == 1 and code in (0, 3), out
        return
    assert code in (0, 3), out  # 3: the analytic plan does not fit (the trace still ran)
    tensors = "fake" if fake and not real_tensors_needed(full.cfg, full.layout) else "real"
    assert "traced: stage" in out and f"{tensors} tensors" in out, out
